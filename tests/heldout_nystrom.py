"""A Nystromformer classifier, written from the README and docs/ alone (a held-out model).

Tokens ``[batch, seq]`` -> embeddings + learned positions -> encoder blocks under ``md.repeat``
(pre-LayerNorm, Nystrom attention, a GELU MLP) -> LayerNorm, mean over ``seq``, a classifier, CE.

Nystrom attention per head: landmarks are segment means, ``rearrange(q, "batch (landmarks seg)
heads d_head -> ...")`` then ``reduce_mean`` over ``seg`` (the same for k). Three softmax kernels:
``F = softmax(q k_l^T)`` ``[seq, lk]``, ``A = softmax(q_l k_l^T)`` ``[lq, lk]``, ``B = softmax(q_l
k^T)`` ``[lq, key_seq]``; attention = ``F pinv(A) (B v)``. ``pinv(A)`` is the iterative Moore-Penrose
inverse, ``newton`` iterations of ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from
``Z0 = A^T / (max colsum(A) * max rowsum(A))``; ``init="global"`` takes the maxima over the whole
batch and every head (the reference implementation's ``torch.max`` of a tensor), ``init="local"``
per example and head. Square matrices get distinct dim names: ``A [lq, lk]``, ``Z [lk, lq]``.

Legend: b batch, s seq, k key_seq, d d_model, h heads, e d_head, m landmarks (lq/lk/lx), f d_ff,
V vocab, K classes, l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 2
    seq: int = 64
    landmarks: int = 8
    newton: int = 6
    classes: int = 10
    batch: int = 8
    init: str = "global"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=16, landmarks=4, classes=5, batch=4)


def landmarks(t, name: str, m: int):
    """Segment means: ``[batch, seq, heads, d_head]`` -> ``[batch, name, heads, d_head]``."""
    t = md.rearrange(t, "batch (landmarks seg) heads d_head -> batch landmarks seg heads d_head", landmarks=m)
    return md.rename(md.reduce_mean(t, "seg"), landmarks=name)


def pinv(a, cfg: Config):
    """Iterative pseudo-inverse of ``a [batch, heads, lq, lk]``: ``Z [batch, heads, lk, lq]``."""
    lq = a.shape["lq"]
    eye = md.constant(torch.eye(lq.size), [lq, md.Dim("lx", lq.size)])
    over = "lq lk" if cfg.init == "local" else "batch heads lq lk"
    colsum = md.reduce_max(md.reduce_sum(a, "lq"), over.replace("lq ", "").split())
    rowsum = md.reduce_max(md.reduce_sum(a, "lk"), over.replace(" lk", "").split())
    z = a / (colsum * rowsum)       # A^T as a [lk, lq] matrix is A itself: named dims, no transpose

    def az(z):      # A Z: [.., lq, lx]
        return md.einsum("batch heads lq lk, batch heads lk lx -> batch heads lq lx", a, md.rename(z, lq="lx"))

    def mm(x, y):   # [.., lq, lx] x [.., lq, lx] as matrices -> [.., lq, lx]
        return md.einsum("batch heads lq t, batch heads t lx -> batch heads lq lx", md.rename(x, lx="t"), md.rename(y, lq="t"))

    for _ in range(cfg.newton):
        v = az(z)
        inner = 15.0 * eye - mm(v, 7.0 * eye - v)
        outer = 13.0 * eye - mm(v, inner)
        z = 0.25 * md.rename(md.einsum("batch heads lk lq, batch heads lq lx -> batch heads lk lx", z, outer), lx="lq")
    return z


def nystrom_attention(q, k, v, cfg: Config):
    scale = cfg.d_head ** -0.25
    q, k = q * scale, k * scale
    q_l, k_l = landmarks(q, "lq", cfg.landmarks), landmarks(k, "lk", cfg.landmarks)
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    f = md.softmax(md.einsum("batch seq heads d_head, batch lk heads d_head -> batch heads seq lk", q, k_l), "lk")
    a = md.softmax(md.einsum("batch lq heads d_head, batch lk heads d_head -> batch heads lq lk", q_l, k_l), "lk")
    bk = md.softmax(md.einsum("batch lq heads d_head, batch key_seq heads d_head -> batch heads lq key_seq", q_l, k), "key_seq")
    bv = md.einsum("batch heads lq key_seq, batch key_seq heads d_head -> batch heads lq d_head", bk, v)
    zbv = md.einsum("batch heads lk lq, batch heads lq d_head -> batch heads lk d_head", pinv(a, cfg), bv)
    return md.einsum("batch heads seq lk, batch heads lk d_head -> batch seq heads d_head", f, zbv)


def block(x, p, cfg: Config):
    z = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
    q, k, v = (md.einsum(proj, z, p[w]) for w in ("wq", "wk", "wv"))
    y = nystrom_attention(q, k, v, cfg)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
    z = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z, p["w1"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w2"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    V, K, L = md.Dim("vocab", cfg.vocab), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_nystrom") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b], torch.int64)
        wte, wpe = md.param("wte", [V, d], scale=1.0), md.param("wpe", [s, d], scale=0.1)
        ln_f, ln_f_b = md.param("ln_f", [d], init="ones"), md.param("ln_f_b", [d], init="zeros")
        head = md.param("head", [d, K], fan_out=[K])
        stacked = {"ln1": md.param("ln1", [L, d], init="ones"), "ln1_b": md.param("ln1_b", [L, d], init="zeros"),
                   "ln2": md.param("ln2", [L, d], init="ones"), "ln2_b": md.param("ln2_b", [L, d], init="zeros"),
                   **{w: md.param(w, [L, d, h, e], fan_out=[L, h, e]) for w in ("wq", "wk", "wv")},
                   "wo": md.param("wo", [L, h, e, d], fan_out=[L, d]),
                   "w1": md.param("w1", [L, d, f], fan_out=[L, f]), "w2": md.param("w2", [L, f, d], fan_out=[L, d])}
        x = md.gather(wte, ids, "vocab") + wpe
        x = md.repeat(lambda x, p: block(x, p, cfg), x, stacked, L, remat=cfg.remat)
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", ln_f, ln_f_b), "seq")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"wte": wte, "wpe": wpe, "ln_f": ln_f, "ln_f_b": ln_f_b, "head": head, **stacked}
    return md.Model(g, loss, params, feeds, cfg)
