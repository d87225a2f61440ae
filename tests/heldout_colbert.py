"""A ColBERT late-interaction retriever, written from the README and docs/ alone (a held-out model).

Queries ``[batch, qseq]`` and their positive documents ``[batch, dseq]`` (padded: a ``doc_mask``)
are encoded by BERT-style post-norm layers: one shared encoder applied to both
(``encoder="shared"``: the same stacked params read by two ``md.repeat`` calls, the query's over
``layer`` and the document's over ``layer`` too) or a separate document encoder
(``encoder="two"``: a second stack over ``dlayer``). Each token is projected to ``emb`` and
L2-normalised. The score of query ``i`` and document ``j`` is MaxSim: for each query token the
max over the document's (unpadded) tokens of the dot products, summed over query tokens. Every
query scores every document of the batch (``docs`` is ``batch`` renamed) and the loss is the
cross-entropy of picking its own document (in-batch negatives), labels ``md.arange(batch)``.

Legend: b batch, j docs, q qseq, s dseq, d d_model, h heads, e d_head, f d_ff, o emb.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    qseq: int = 8
    dseq: int = 16
    emb: int = 16
    batch: int = 8
    encoder: str = "two"      # or "shared"
    temp: float = 0.1
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, qseq=4, dseq=6, emb=8, batch=4)


def _encoder_params(prefix: str, L: md.Dim, d, h, e, f) -> dict:
    lay = L.name
    return {
        "wq": md.param(f"{prefix}wq", [L, d, h, e], fan_out=[lay, "heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", [L, d, h, e], fan_out=[lay, "heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", [L, d, h, e], fan_out=[lay, "heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [L, h, e, d], fan_out=[lay, "d_model"]),
        "ln1": md.param(f"{prefix}ln1", [L, d], init="ones"), "ln1_b": md.param(f"{prefix}ln1_b", [L, d], init="zeros"),
        "w1": md.param(f"{prefix}w1", [L, d, f], fan_out=[lay, "d_ff"]),
        "w2": md.param(f"{prefix}w2", [L, f, d], fan_out=[lay, "d_model"]),
        "ln2": md.param(f"{prefix}ln2", [L, d], init="ones"), "ln2_b": md.param(f"{prefix}ln2_b", [L, d], init="zeros"),
    }


def _encode(x, p, seq: str, mask, layer: str, remat: str):
    """Post-norm BERT layers over ``seq``; ``mask [batch, key]`` (or None) hides padded keys."""
    key = f"key_{seq}"

    def block(x, p):
        q = md.einsum(f"batch {seq} d_model, d_model heads d_head -> batch {seq} heads d_head", x, p["wq"])
        xk = md.rename(x, **{seq: key})
        k = md.einsum(f"batch {key} d_model, d_model heads d_head -> batch {key} heads d_head", xk, p["wk"])
        v = md.einsum(f"batch {key} d_model, d_model heads d_head -> batch {key} heads d_head", xk, p["wv"])
        if mask is None:
            o = md.attention(q, k, v, seq, key, "d_head", causal=False)
        else:
            s = md.einsum(f"batch {seq} heads d_head, batch {key} heads d_head -> batch heads {seq} {key}", q, k)
            a = md.softmax(md.where(mask, s * q.shape["d_head"].size ** -0.5, -1e9), key)
            o = md.einsum(f"batch heads {seq} {key}, batch {key} heads d_head -> batch {seq} heads d_head", a, v)
        x = md.layer_norm(x + md.einsum(f"batch {seq} heads d_head, heads d_head d_model -> batch {seq} d_model",
                                        o, p["wo"]), "d_model", p["ln1"], p["ln1_b"])
        y = md.einsum(f"batch {seq} d_ff, d_ff d_model -> batch {seq} d_model",
                      md.gelu(md.einsum(f"batch {seq} d_model, d_model d_ff -> batch {seq} d_ff", x, p["w1"])),
                      p["w2"])
        return md.layer_norm(x + y, "d_model", p["ln2"], p["ln2_b"])

    return md.repeat(block, x, p, layer, remat=remat)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.encoder not in ("two", "shared"):
        raise ValueError(f"encoder must be 'two' or 'shared', not {cfg.encoder!r}")
    b, qs, ds = md.Dim("batch", cfg.batch), md.Dim("qseq", cfg.qseq), md.Dim("dseq", cfg.dseq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, o = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("emb", cfg.emb)
    L = md.Dim("layer", cfg.layers)
    with md.Graph("heldout_colbert") as graph:
        q_ids = md.input("q_ids", [b, qs], dtype=torch.int64)
        d_ids = md.input("d_ids", [b, ds], dtype=torch.int64)
        d_len = md.input("d_len", [b], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        wq_pos, wd_pos = md.param("q_pos", [qs, d], scale=0.1), md.param("d_pos", [ds, d], scale=0.1)
        proj = md.param("proj", [d, o], fan_out=["emb"])
        qp = _encoder_params("", L, d, h, e, f)
        dp = qp if cfg.encoder == "shared" else _encoder_params("doc_", md.Dim("dlayer", cfg.layers), d, h, e, f)
        d_layer = "layer" if cfg.encoder == "shared" else "dlayer"

        keep = md.less(md.arange(ds), d_len)                                          # [dseq, batch]
        key_keep = md.rename(keep, dseq="key_dseq")
        qx = _encode(md.gather(wte, q_ids, "vocab") + wq_pos, qp, "qseq", None, "layer", cfg.remat)
        dx = _encode(md.gather(wte, d_ids, "vocab") + wd_pos, dp, "dseq", key_keep, d_layer, cfg.remat)

        def embed(x, seq):
            y = md.einsum(f"batch {seq} d_model, d_model emb -> batch {seq} emb", x, proj)
            return y * md.rsqrt(md.reduce_sum(y * y, "emb") + 1e-6)

        qe = embed(qx, "qseq")
        de = md.rename(embed(dx, "dseq"), batch="docs")
        sim = md.einsum("batch qseq emb, docs dseq emb -> batch docs qseq dseq", qe, de)
        sim = md.where(md.rename(keep, batch="docs"), sim, -1e4)
        scores = md.reduce_sum(md.reduce_max(sim, "dseq"), "qseq") / cfg.temp          # [batch, docs]
        loss = md.reduce_mean(md.cross_entropy(scores, md.arange(b), "docs"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        d_ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.dseq), generator=g)
        q_ids = torch.cat([d_ids[:, : cfg.qseq // 2],
                           torch.randint(0, cfg.vocab, (cfg.batch, cfg.qseq - cfg.qseq // 2), generator=g)], 1)
        d_len = torch.randint(cfg.dseq // 2, cfg.dseq + 1, (cfg.batch,), generator=g)
        return {"q_ids": q_ids, "d_ids": d_ids, "d_len": d_len}

    params = {"wte": wte, "q_pos": wq_pos, "d_pos": wd_pos, "proj": proj, **qp,
              **({} if cfg.encoder == "shared" else {f"doc_{k}": t for k, t in dp.items()})}
    return md.Model(graph, loss, params, feeds, cfg, logits=scores)
