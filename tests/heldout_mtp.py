"""A decoder with DeepSeek-V3-style multi-token prediction, written from README.md and docs/ alone
(a held-out model).

Legend: b batch, s seq (``key_seq``), d d_model (``d_cat``: two of them side by side), h heads,
e d_head, f d_ff, v vocab, l layer (the trunk), m mtp (the prediction depths, a second stack).

    ids [b, s] -> wte -> md.repeat over layer (pre-RMSNorm, causal attention, SwiGLU) = h_0
    main loss: CE of head(norm(h_0)) against the next token
    md.repeat over mtp, depth k = 1..D, carry h_{k-1}:
        h_k = block_k(W_k [norm(h_{k-1}) ; norm(emb(t_{i+k}))])   (concat along d_model)
        its loss: CE of the SHARED head(norm(h_k)) against t_{i+k+1}, over the positions where
        that token exists (masked mean), a per-depth output
    loss = main + mtp_weight / D * sum over depths

The depth-shifted inputs are stacked ``[mtp, ...]`` tensors the mtp repeat scans beside its
weights: the shifted embeddings (an activation with the batch) and the shifted labels and
their mask, and each depth's count of valid positions (``count="outside"``: made before the
stack from the inputs, so it is a whole-batch count under micro-batches; ``count="block"``
makes it in the block from the stacked targets, which is refused under micro-batches: there
each micro-batch's count would be a part of it). ``shift`` picks how they are made: ``einsum`` (a constant one-hot shift matrix
``[mtp, seq, key_seq]``, labels as one-hot soft targets) or ``shift`` (``md.shift`` by
-k per depth, ``md.unsqueeze`` + ``md.concat`` over ``mtp``, integer labels and a position mask).
The embedding table and the output head are shared by the trunk and every depth.
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
    d_ff: int = 64
    layers: int = 2
    depths: int = 2
    mtp_weight: float = 0.3
    shift: str = "einsum"
    count: str = "outside"    # each depth's count of its valid positions: made before the stack, or in its block
    remat: str = "none"       # what each layer saves for its backward (md.repeat remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, depths=2)


def block(x: md.Tensor, p: dict) -> md.Tensor:
    hdn = md.rms_norm(x, "d_model", p["attn_norm"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", hdn, p["wq"])
    kv_in = md.rename(hdn, seq="key_seq")
    k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv_in, p["wk"])
    v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv_in, p["wv"])
    o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    hdn = md.rms_norm(x, "d_model", p["mlp_norm"])
    u = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", hdn, p["w_gate"])) \
        * md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", hdn, p["w_up"])
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])


def block_params(l: md.Dim, d, h, e, f, prefix: str) -> dict:
    n = prefix
    return {
        "attn_norm": md.param(n + "attn_norm", [l, d], init="ones"),
        "wq": md.param(n + "wq", [l, d, h, e], fan_out=[l, h, e]),
        "wk": md.param(n + "wk", [l, d, h, e], fan_out=[l, h, e]),
        "wv": md.param(n + "wv", [l, d, h, e], fan_out=[l, h, e]),
        "wo": md.param(n + "wo", [l, h, e, d], fan_out=[l, d]),
        "mlp_norm": md.param(n + "mlp_norm", [l, d], init="ones"),
        "w_gate": md.param(n + "w_gate", [l, d, f], fan_out=[l, f]),
        "w_up": md.param(n + "w_up", [l, d, f], fan_out=[l, f]),
        "w_down": md.param(n + "w_down", [l, f, d], fan_out=[l, d]),
    }


def logits_of(h: md.Tensor, norm_f, head) -> md.Tensor:
    return md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(h, "d_model", norm_f), head)


def depth(h: md.Tensor, p: dict, norm_f, head, cfg: Config):
    both = md.concat([md.rms_norm(h, "d_model", p["h_norm"]), md.rms_norm(p["emb"], "d_model", p["e_norm"])], "d_model")
    x = md.einsum("batch seq d_cat, d_cat d_model -> batch seq d_model", md.rename(both, d_model="d_cat"), p["w_proj"])
    x = block(x, p)
    logits = logits_of(x, norm_f, head)
    if cfg.shift == "einsum":
        ce = -md.reduce_sum(p["target"] * md.log_softmax(logits, "vocab"), "vocab")       # [b, s]
        valid = md.reduce_sum(p["target"], "vocab")
    else:
        valid = md.broadcast_to(md.cast(p["valid"], torch.float32), p["target"].shape)   # [s] -> [b, s]
        ce = md.cross_entropy(logits, p["target"], "vocab") * valid
    count = md.reduce_sum(valid) if cfg.count == "block" else p["count"]
    return x, {"loss": md.reduce_sum(ce) / count}


def shifted(ids, labels, emb, cfg: Config, m: md.Dim) -> dict:
    """The per-depth stacked inputs: emb of t_{i+k} and the targets t_{i+k+1} (k = 1..D)."""
    s = ids.shape["seq"]
    if cfg.shift == "einsum":
        eye = torch.zeros(cfg.depths, cfg.seq, cfg.seq)
        for k in range(1, cfg.depths + 1):
            eye[k - 1] += torch.diag(torch.ones(cfg.seq - k), k)          # [i, j] = 1 where j = i + k
        shift = md.constant(eye, [m, s, md.Dim("key_seq", cfg.seq)], name="depth_shift")
        e = md.einsum("mtp seq key_seq, batch key_seq d_model -> mtp batch seq d_model", shift, md.rename(emb, seq="key_seq"))
        onehot = md.rename(md.one_hot(labels, md.Dim("vocab", cfg.vocab), torch.float32), seq="key_seq")
        t = md.einsum("mtp seq key_seq, batch key_seq vocab -> mtp batch seq vocab", shift, onehot)
        return {"emb": e, "target": t, "count": md.reduce_sum(t, ["batch", "seq", "vocab"])}
    pos = md.arange(s)
    es, ts, vs = [], [], []
    for k in range(1, cfg.depths + 1):
        es.append(md.unsqueeze(md.shift(emb, "seq", -k), "mtp", 0))
        ts.append(md.unsqueeze(md.shift(labels, "seq", -k), "mtp", 0))
        vs.append(md.unsqueeze(md.less(pos, cfg.seq - k), "mtp", 0))
    valid = md.concat(vs, "mtp")
    count = md.reduce_sum(md.broadcast_to(md.cast(valid, torch.float32), [m, ids.shape["batch"], s]), ["batch", "seq"])
    return {"emb": md.concat(es, "mtp"), "target": md.concat(ts, "mtp"), "valid": valid, "count": count}


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, l, m = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers), md.Dim("mtp", cfg.depths)
    cat = md.Dim("d_cat", 2 * cfg.d_model)
    with md.Graph("heldout_mtp") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        trunk = block_params(l, d, h, e, f, "")
        mtp = block_params(m, d, h, e, f, "mtp_")
        mtp.update(h_norm=md.param("mtp_h_norm", [m, d], init="ones"), e_norm=md.param("mtp_e_norm", [m, d], init="ones"),
                   w_proj=md.param("mtp_w_proj", [m, cat, d], fan_out=[m, d]))
        norm_f = md.param("norm_f", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])

        emb = md.gather(wte, ids, "vocab")
        h0 = md.repeat(block, emb, trunk, l, remat=cfg.remat)
        logits = logits_of(h0, norm_f, head)
        main = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        _, per_depth = md.repeat(lambda x, p: depth(x, p, norm_f, head, cfg), h0,
                                 {**mtp, **shifted(ids, labels, emb, cfg, m)}, m, remat=cfg.remat)
        loss = main + cfg.mtp_weight / cfg.depths * md.reduce_sum(per_depth["loss"], "mtp")

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    params = {"wte": wte, **trunk, **{"mtp_" + k: t for k, t in mtp.items()}, "norm_f": norm_f, "head": head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits, outputs={"mtp/loss": per_depth["loss"]})
