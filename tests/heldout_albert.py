"""ALBERT, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``emb`` (the factorized embedding's width), ``d_model``,
``heads``, ``d_head``, ``d_ff``, ``vocab``, ``layer``. One transformer layer's weights are shared
by every layer: ``md.repeat`` scans ``layer`` with no stacked params (``{}``), and its block reads
the single layer's params from outside (as the docs say a block may read any tensor of the graph
around it; their gradient is the sum of the layers'), pipelined over ``layer`` as any stack.
``shared="broadcast"`` is the other way to write it: the repeat gets ``md.broadcast_to(w, [layer,
...])`` of each shared weight as stacked params (the same numbers: broadcast_to's gradient sums the
layers'). The embedding is factorized: ``vocab x
emb`` then ``emb x d_model``; post-norm LayerNorm blocks with bidirectional attention under a
padding mask from per-row lengths (composite: einsum, ``md.where``, softmax, einsum); a masked-LM
loss on the fed ``weights`` positions through ``d_model -> emb`` and the embedding's transpose,
plus a sentence-order head (a 2-way classifier on the first token) as ALBERT's SOP loss.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    emb: int = 16
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 6
    seq: int = 32
    batch: int = 8
    mask_rate: float = 0.15
    shared: str = "closure"    # "closure": the block reads the layer's params; "broadcast": stacked copies

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, emb=6, d_model=16, heads=4, d_head=4, d_ff=24, layers=4, seq=8, batch=4, mask_rate=0.3)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    emb, d_model, heads = md.Dim("emb", cfg.emb), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    d_head, d_ff, vocab = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab)
    layer, sop = md.Dim("layer", cfg.layers), md.Dim("sop", 2)
    with md.Graph("heldout_albert") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        weights = md.input("weights", [batch, seq])
        lengths = md.input("lengths", [batch], dtype=torch.int64)
        order = md.input("order", [batch], dtype=torch.int64)
        params = {
            "word_emb": md.param("word_emb", [vocab, emb], scale=0.1),
            "emb_proj": md.param("emb_proj", [emb, d_model], fan_out=[d_model]),
            "pos_emb": md.param("pos_emb", [seq, d_model], scale=0.02),
            "emb_norm": md.param("emb_norm", [d_model], init="ones"),
            # the one shared layer
            "wq": md.param("wq", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "wv": md.param("wv", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "wo": md.param("wo", [heads, d_head, d_model], fan_out=[d_model]),
            "norm1": md.param("norm1", [d_model], init="ones"),
            "norm1_b": md.param("norm1_b", [d_model], init="zeros"),
            "w_in": md.param("w_in", [d_model, d_ff], fan_out=[d_ff]),
            "b_in": md.param("b_in", [d_ff], init="zeros"),
            "w_out": md.param("w_out", [d_ff, d_model], fan_out=[d_model]),
            "norm2": md.param("norm2", [d_model], init="ones"),
            "norm2_b": md.param("norm2_b", [d_model], init="zeros"),
            # heads
            "mlm_proj": md.param("mlm_proj", [d_model, emb], fan_out=[emb]),
            "mlm_bias": md.param("mlm_bias", [vocab], init="zeros"),
            "sop_w": md.param("sop_w", [d_model, sop], fan_out=[sop]),
        }
        valid = md.less(md.arange(key_seq), lengths)                 # [key_seq, batch]

        names = ["wq", "wk", "wv", "wo", "norm1", "norm1_b", "w_in", "b_in", "w_out", "norm2", "norm2_b"]
        if cfg.shared == "broadcast":   # the shared weights as [layer, ...] copies: the gradient sums the layers'
            stacked = {n: md.broadcast_to(params[n], [layer, *params[n].shape]) for n in names}
        else:
            stacked = {}

        def block(x, per_layer):
            p = {**params, **per_layer}
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(valid, s * cfg.d_head ** -0.5, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            x = md.layer_norm(x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"]),
                              "d_model", p["norm1"], p["norm1_b"])
            h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["w_in"]) + p["b_in"])
            return md.layer_norm(x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w_out"]),
                                 "d_model", p["norm2"], p["norm2_b"])

        p = params
        e = md.gather(p["word_emb"], ids, "vocab")                    # [batch, seq, emb]
        x = md.einsum("batch seq emb, emb d_model -> batch seq d_model", e, p["emb_proj"]) + p["pos_emb"]
        x = md.repeat(block, md.layer_norm(x, "d_model", p["emb_norm"]), stacked, layer)
        # masked LM: d_model -> emb, then the word embedding's transpose
        h = md.gelu(md.einsum("batch seq d_model, d_model emb -> batch seq emb", x, p["mlm_proj"]))
        logits = md.einsum("batch seq emb, vocab emb -> batch seq vocab", h, p["word_emb"]) + p["mlm_bias"]
        ce = md.cross_entropy(logits, labels, "vocab")
        mlm = md.reduce_sum(ce * weights) / md.reduce_sum(weights)
        # sentence order: the first token's state
        first = md.squeeze(md.slice_(x, "seq", 0, 1), "seq")
        sop_logits = md.einsum("batch d_model, d_model sop -> batch sop", first, p["sop_w"])
        loss = mlm + md.reduce_mean(md.cross_entropy(sop_logits, order, "sop"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)   # id 0 is [MASK]
        lengths = torch.randint(cfg.seq // 2, cfg.seq + 1, (cfg.batch,), generator=gen)
        masked = (torch.rand(cfg.batch, cfg.seq, generator=gen) < cfg.mask_rate) & \
            (torch.arange(cfg.seq) < lengths[:, None])
        masked[:, 1] = True                                                          # one per row at least
        return {"ids": torch.where(masked, 0, tokens), "labels": tokens, "weights": masked.float(),
                "lengths": lengths, "order": torch.randint(0, 2, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, feeds, cfg)
