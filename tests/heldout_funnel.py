"""A Funnel-Transformer-style encoder, written from README.md and docs/ alone (a held-out model).

Legend: b batch, s seq (``key_seq``), p pooled (``key_pooled``: seq / 2), r pair (the two
positions pooled into one), d d_model, h heads, e d_head, f d_ff, v vocab, c classes,
``layer1`` / ``layer2`` the two block groups' stacks.

    ids [b, s] -> wte + wpe -> md.repeat over layer1 (full length: bidirectional attention, gelu MLP, post-LN)
      -> pool by 2: rearrange seq -> (pooled pair), mean over pair         [b, p, d]
      -> the first pooled layer's attention: pooled queries against the full-length keys and
         values (Funnel's pool-query-only attention; its residual is the pooled stream)
      -> md.repeat over layer2 (pooled length)
      -> upsample: each pooled row repeated for its pair, back to seq, plus the layer1 output
         (Funnel's decoder residual), one post-LN dense layer
      -> token-level CE on the masked positions (an MLM) + a sequence classification CE on the
         mean of the pooled stream, weighted ``cls_weight``.

``pool`` picks the pooling: ``mean`` (rearrange + reduce_mean), ``reshape`` (md.reshape to
``[b, p, r, d]`` then the mean) or ``strided`` (the even positions only, ``md.conv``-free: a
``slice_`` of the pair dim after the rearrange).
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
    classes: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers1: int = 2
    layers2: int = 2
    mask_every: int = 4       # every 4th token (shifted per row) is masked and predicted
    cls_weight: float = 0.5
    pool: str = "mean"
    remat: str = "none"       # what each layer saves for its backward (md.repeat remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, classes=3, d_model=8, heads=2, d_head=4, d_ff=16, layers1=2, layers2=2)


def attn(x_q: md.Tensor, x_kv: md.Tensor, p: dict, q_dim: str, k_dim: str) -> md.Tensor:
    """Bidirectional multi-head attention of ``x_q`` ([.., q_dim, d]) over ``x_kv`` ([.., k_dim, d])."""
    q = md.einsum(f"batch {q_dim} d_model, d_model heads d_head -> batch {q_dim} heads d_head", x_q, p["wq"])
    kv = x_kv
    k = md.einsum(f"batch {k_dim} d_model, d_model heads d_head -> batch {k_dim} heads d_head", kv, p["wk"])
    v = md.einsum(f"batch {k_dim} d_model, d_model heads d_head -> batch {k_dim} heads d_head", kv, p["wv"])
    o = md.attention(q, k, v, q_dim, k_dim, "d_head", causal=False)
    return md.einsum(f"batch {q_dim} heads d_head, heads d_head d_model -> batch {q_dim} d_model", o, p["wo"])


def mlp(x: md.Tensor, p: dict, pos: str) -> md.Tensor:
    u = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", x, p["w1"]))
    return md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", u, p["w2"])


def layer(x: md.Tensor, p: dict, pos: str) -> md.Tensor:
    kv = md.rename(x, {pos: "key_" + pos})
    x = md.layer_norm(x + attn(x, kv, p, pos, "key_" + pos), "d_model", p["ln1"])
    return md.layer_norm(x + mlp(x, p, pos), "d_model", p["ln2"])


def pool(x: md.Tensor, cfg: Config) -> md.Tensor:
    pooled = md.Dim("pooled", cfg.seq // 2)
    if cfg.pool == "reshape":
        pairs = md.reshape(x, [x.shape["batch"], pooled, md.Dim("pair", 2), x.shape["d_model"]])
    else:
        pairs = md.rearrange(x, "batch (pooled pair) d_model -> batch pooled pair d_model", pair=2)
    if cfg.pool == "strided":
        return md.squeeze(md.slice_(pairs, "pair", 0, 1), "pair")
    return md.reduce_mean(pairs, "pair")


def stacked(names_shapes: dict, l: md.Dim, prefix: str) -> dict:
    out = {}
    for k, (dims, fan) in names_shapes.items():
        init = {"init": "ones"} if k.startswith("ln") else {"fan_out": [l, *fan]}
        out[k] = md.param(prefix + k, [l, *dims], **init)
    return out


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, c = md.Dim("vocab", cfg.vocab), md.Dim("classes", cfg.classes)
    l1, l2 = md.Dim("layer1", cfg.layers1), md.Dim("layer2", cfg.layers2)
    shapes = {"wq": ([d, h, e], [h, e]), "wk": ([d, h, e], [h, e]), "wv": ([d, h, e], [h, e]), "wo": ([h, e, d], [d]),
              "w1": ([d, f], [f]), "w2": ([f, d], [d]), "ln1": ([d], []), "ln2": ([d], [])}
    with md.Graph("heldout_funnel") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        masked = md.input("masked", [b, s])                 # 1.0 where the token was masked
        cls_label = md.input("cls_label", [b], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        wpe = md.param("wpe", [s, d], scale=0.1)
        g1, g2 = stacked(shapes, l1, "g1_"), stacked(shapes, l2, "g2_")
        cross = {k: md.param("x_" + k, dims, **({"init": "ones"} if k.startswith("ln") else {"fan_out": fan}))
                 for k, (dims, fan) in shapes.items()}
        dec = {"w1": md.param("dec_w1", [d, f], fan_out=[f]), "w2": md.param("dec_w2", [f, d], fan_out=[d]),
               "ln": md.param("dec_ln", [d], init="ones")}
        lnc = md.param("cls_w", [d, c], fan_out=[c])
        head = md.param("head", [v, d], fan_out=[v])

        x = md.gather(wte, ids, "vocab") + wpe
        full = md.repeat(lambda t, p: layer(t, p, "seq"), x, g1, l1, remat=cfg.remat)
        pooled = pool(full, cfg)                                                 # [b, pooled, d]
        y = md.layer_norm(pooled + attn(pooled, md.rename(full, seq="key_seq"), cross, "pooled", "key_seq"),
                          "d_model", cross["ln1"])
        y = md.layer_norm(y + mlp(y, cross, "pooled"), "d_model", cross["ln2"])
        y = md.repeat(lambda t, p: layer(t, p, "pooled"), y, g2, l2, remat=cfg.remat)
        pairs = md.broadcast_to(y, [b, y.shape["pooled"], md.Dim("pair", 2), d])        # each pooled row twice
        up = md.rearrange(pairs, "batch pooled pair d_model -> batch (pooled pair) d_model")
        up = md.rename(up, pooled_pair="seq") + full
        up = md.layer_norm(up + mlp(up, dec, "seq"), "d_model", dec["ln"])
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", up, head)
        mlm = md.reduce_sum(md.cross_entropy(logits, labels, "vocab") * masked) / md.reduce_sum(masked)
        cls_logits = md.einsum("batch d_model, d_model classes -> batch classes", md.reduce_mean(y, "pooled"), lnc)
        cls = md.reduce_mean(md.cross_entropy(cls_logits, cls_label, "classes"))
        loss = mlm + cfg.cls_weight * cls

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        pos = torch.arange(cfg.seq)[None, :] + torch.arange(cfg.batch)[:, None]
        m = (pos % cfg.mask_every == 0)
        return {"ids": torch.where(m, 0, tokens), "labels": tokens, "masked": m.float(),
                "cls_label": tokens[:, 0] % cfg.classes}

    params = {"wte": wte, "wpe": wpe, **{"g1_" + k: t for k, t in g1.items()}, **{"g2_" + k: t for k, t in g2.items()},
              **{"x_" + k: t for k, t in cross.items()}, **{"dec_" + k: t for k, t in dec.items()},
              "cls_w": lnc, "head": head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
