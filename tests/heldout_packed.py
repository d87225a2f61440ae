"""A decoder trained on packed sequences, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``d_model``, ``heads``, ``d_head``, ``d_ff``, ``vocab``,
``layer``. Several documents of random lengths are packed into each row, the rest of the row
is padding. Inputs: ``ids``, ``labels`` (-100 on each document's last token and on padding, as
Hugging Face's ignore_index), ``segments`` (the document's number in its row; padding has its
own, -1) and ``positions`` (the position within its document, restarting at 0). Attention is
block-diagonal and causal: a query sees the keys of its own document up to itself, the mask made
from the fed ``segments`` (``md.equal`` of the query's and the key's, ``[batch, seq, key_seq]``)
and the positions in the graph (``md.arange``), applied in a composite attention. Learned
position embeddings are gathered by the fed positions. The loss is the cross-entropy averaged
over the real labels only: the -100s are masked as the docs say (``keep = labels >= 0``,
``md.where(keep, labels, 0)``), and divided by the count of kept labels over the whole batch.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 4
    seq: int = 64
    batch: int = 8
    max_doc: int = 24
    ignore_index: int = -100

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=4, d_head=4, d_ff=24, layers=4, seq=12, batch=4, max_doc=5)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_packed") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        segments = md.input("segments", [batch, seq], dtype=torch.int64)
        positions = md.input("positions", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [md.Dim("pos", cfg.seq), d_model], scale=0.1)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        lnf = md.param("lnf", [d_model], init="ones")

        # block-diagonal causal mask [batch, seq, key_seq]: same document, key not after the query
        same_doc = md.equal(segments, md.rename(segments, seq="key_seq"))
        allowed = md.logical_and(same_doc, md.causal_mask(seq, key_seq))

        def block(x, p):
            h = md.layer_norm(x, "d_model", p["ln1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(allowed, s * cfg.d_head ** -0.5, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            m = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                                  md.layer_norm(x, "d_model", p["ln2"]), p["w_fc"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", m, p["w_proj"])

        x = md.gather(wte, ids, "vocab") + md.gather(wpe, positions, "pos")
        x = md.layer_norm(md.repeat(block, x, blocks, "layer"), "d_model", lnf)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte)
        keep = md.greater_equal(labels, 0)
        ce = md.cross_entropy(logits, md.where(keep, labels, 0), "vocab") * md.cast(keep, torch.float32)
        loss = md.reduce_sum(ce) / md.reduce_sum(md.cast(keep, torch.float32))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        labels = torch.full((cfg.batch, cfg.seq), cfg.ignore_index)
        segments = torch.full((cfg.batch, cfg.seq), -1)
        positions = torch.zeros(cfg.batch, cfg.seq, dtype=torch.int64)
        for b in range(cfg.batch):
            start, doc = 0, 0
            while start < cfg.seq - 1:            # documents until the row is (nearly) full; the rest is padding
                n = min(int(torch.randint(2, cfg.max_doc + 1, (), generator=gen)), cfg.seq - start)
                if doc and torch.rand((), generator=gen) < 0.2:
                    break
                segments[b, start:start + n] = doc
                positions[b, start:start + n] = torch.arange(n)
                labels[b, start:start + n - 1] = ids[b, start + 1:start + n]     # next token within the document
                start, doc = start + n, doc + 1
        return {"ids": ids, "labels": labels, "segments": segments, "positions": positions}

    return md.Model(g, loss, {"wte": wte, "wpe": wpe, **blocks, "lnf": lnf}, feeds, cfg, logits=logits)
