"""A Differential Transformer decoder, written from the README and docs/ alone (a held-out model).

Each head has two query/key pairs (along ``pair``) and one value of twice the width. Its two causal
softmax maps are subtracted, ``softmax(q1 k1) - lambda * softmax(q2 k2)``, with a learnable
``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` per layer (``lq*``, ``lk*`` small vectors
over ``d_head``; ``lambda_init = 0.8 - 0.6 exp(-0.3 l)`` a constant stacked over ``layer``). The head
outputs get a per-head RMSNorm over ``d_v`` (GroupNorm-like), times ``1 - lambda_init``; then the
output projection, a SwiGLU MLP, pre-RMSNorm, blocks under ``md.repeat``, the next-token loss.

``form="composite"`` writes both maps as einsum + masked softmax; ``form="fused"`` runs
``md.attention`` on the ``pair``-batched q, k against one v (a dim v lacks is a batch dim) and
subtracts the two outputs (attention is linear in its maps). v's feature dim must be q's, so v is
cut ``(vh d_head)``, q and k broadcast over ``vh`` and v over ``pair`` (k and v must share their
batch dims): each map is computed twice, the price of fusing.

Legend: b batch, s seq, k key_seq, d d_model, h heads, p pair (2), e d_head, v d_v (2 d_head),
f d_ff, V vocab, l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 4
    seq: int = 64
    batch: int = 8
    form: str = "composite"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


def diff_attention(q, k, v, lam, cfg: Config):
    """``[b s h p e]`` q and ``[b k h p e]`` k against ``[b k h v]`` v: map 1 minus lambda x map 2."""
    if cfg.form == "fused":
        # v's feature dim must be q's: cut d_v into (vh d_head), q read by both halves
        vh = md.Dim("vh", 2)
        v = md.rearrange(v, "batch key_seq heads (vh d_head) -> batch key_seq heads vh d_head", vh=2)
        q = md.broadcast_to(q, [q.shape[n] for n in ("batch", "seq", "heads", "pair")] + [vh, q.shape["d_head"]])
        kv_dims = [k.shape[n] for n in ("batch", "key_seq", "heads", "pair")] + [vh, k.shape["d_head"]]
        k, v = md.broadcast_to(k, kv_dims), md.broadcast_to(v, kv_dims)      # k and v share their batch dims
        y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)   # [b s h p vh e]
        y = md.rearrange(y, "batch seq heads pair vh d_head -> batch seq heads pair (vh d_head)")
        y = md.rename(y, vh_d_head="d_v")
    else:
        scores = md.einsum("batch seq heads pair d_head, batch key_seq heads pair d_head -> "
                           "batch heads pair seq key_seq", q, k) * cfg.d_head ** -0.5
        mask = md.causal_mask(q.shape["seq"], k.shape["key_seq"])
        att = md.softmax(md.where(mask, scores, -1e9), "key_seq")
        y = md.einsum("batch heads pair seq key_seq, batch key_seq heads d_v -> batch seq heads pair d_v", att, v)
    sign = md.constant(torch.tensor([1.0, 0.0]), ["pair"]) - md.constant(torch.tensor([0.0, 1.0]), ["pair"]) * lam
    return md.reduce_sum(y * sign, "pair")


def block(x, p, lam_init, cfg: Config):
    z = md.rms_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads pair d_head -> batch seq heads pair d_head", z, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads pair d_head -> batch seq heads pair d_head", z, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_v -> batch seq heads d_v", z, p["wv"])
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    dots = md.reduce_sum(p["lq"] * p["lk"], "d_head")                          # [pair]
    lam_pair = md.exp(dots)
    lam = (md.reduce_sum(lam_pair * md.constant(torch.tensor([1.0, -1.0]), ["pair"]), "pair") + lam_init)
    y = diff_attention(q, k, v, lam, cfg)
    y = md.rms_norm(y, "d_v", p["sub_ln"]) * (1.0 - lam_init)
    x = x + md.einsum("batch seq heads d_v, heads d_v d_model -> batch seq d_model", y, p["wo"])
    z = md.rms_norm(x, "d_model", p["ln2"])
    up = "batch seq d_model, d_model d_ff -> batch seq d_ff"
    u = md.silu(md.einsum(up, z, p["w_gate"])) * md.einsum(up, z, p["w_up"])
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, pr, e = md.Dim("heads", cfg.heads), md.Dim("pair", 2), md.Dim("d_head", cfg.d_head)
    dv, f, V, L = md.Dim("d_v", 2 * cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_difftf") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [V, d], scale=1.0)
        head = md.param("head", [d, V], fan_out=[V])
        ln_f = md.param("ln_f", [d], init="ones")
        stacked = {
            "ln1": md.param("ln1", [L, d], init="ones"),
            "ln2": md.param("ln2", [L, d], init="ones"),
            "sub_ln": md.param("sub_ln", [L, dv], init="ones"),
            "wq": md.param("wq", [L, d, h, pr, e], fan_out=[L, h, pr, e]),
            "wk": md.param("wk", [L, d, h, pr, e], fan_out=[L, h, pr, e]),
            "wv": md.param("wv", [L, d, h, dv], fan_out=[L, h, dv]),
            "wo": md.param("wo", [L, h, dv, d], fan_out=[L, d]),
            "lq": md.param("lq", [L, pr, e], scale=0.1),
            "lk": md.param("lk", [L, pr, e], scale=0.1),
            "w_gate": md.param("w_gate", [L, d, f], fan_out=[L, f]),
            "w_up": md.param("w_up", [L, d, f], fan_out=[L, f]),
            "w_down": md.param("w_down", [L, f, d], fan_out=[L, d]),
        }
        init = 0.8 - 0.6 * torch.exp(-0.3 * torch.arange(cfg.layers, dtype=torch.float32))
        lam_inits = md.constant(init, [L])

        def layer(x, p):
            return block(x, p, p["lam_init"], cfg)

        x = md.repeat(layer, md.gather(wte, ids, "vocab"), {**stacked, "lam_init": lam_inits}, L, remat=cfg.remat)
        x = md.rms_norm(x, "d_model", ln_f)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, "head": head, "ln_f": ln_f, **stacked}, feeds, cfg, logits=logits)
