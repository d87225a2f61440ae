"""A Longformer-style encoder classifier, written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``seq`` (``key_seq``), ``d_model``, ``heads``, ``d_head``, ``d_ff``, ``vocab``,
``classes``, ``layer``. Attention is a sliding window of ``window`` tokens on each side plus
global tokens chosen per example by a fed ``is_global [batch, seq]`` (token 0, the [CLS], is
always global; a question's tokens would be too): every query sees the global keys, and a global
query sees every key. As in Longformer, global queries use projections of their own
(``wq_g``, ``wk_g``, ``wv_g``): a global row's output comes from them, every other row's from the
local projections, merged by ``md.where`` on ``is_global``. Padding past each row's fed
``lengths`` is masked out of the keys. The masks are ``[batch, seq, key_seq]``, built from
``md.arange`` and the fed inputs with ``md.logical_or``/``md.logical_and``, in composite
attention. Post-norm LayerNorm blocks under ``md.repeat``; the loss is the cross-entropy of a
classifier on token 0.
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
    classes: int = 3
    window: int = 4
    num_global: int = 3        # global tokens per row besides token 0 (random places)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=4, d_head=4, d_ff=24, layers=4, seq=12, batch=4, window=2,
                   num_global=2)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    classes = md.Dim("classes", cfg.classes)
    proj = lambda n: md.param(n, [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head])
    with md.Graph("heldout_longformer") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        is_global = md.input("is_global", [batch, seq], dtype=torch.bool)
        lengths = md.input("lengths", [batch], dtype=torch.int64)
        label = md.input("label", [batch], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        wpe = md.param("wpe", [seq, d_model], scale=0.1)
        blocks = {
            **{n: proj(n) for n in ("wq", "wk", "wv", "wq_g", "wk_g", "wv_g")},
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
        }
        w_cls = md.param("w_cls", [d_model, classes], fan_out=[classes])

        # masks [batch, seq, key_seq]
        real_key = md.less(md.arange(key_seq), lengths)                               # [key_seq, batch]
        global_key = md.rename(is_global, seq="key_seq")
        near = md.less_equal(md.abs(md.arange(seq) - md.arange(key_seq)), cfg.window)
        local_ok = md.logical_and(md.logical_or(near, global_key), real_key)

        def attend(x, wq, wk, wv, allowed):
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, wq)
            xk = md.rename(x, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", xk, wk)
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", xk, wv)
            s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(allowed, s * cfg.d_head ** -0.5, -1e9), "key_seq")
            return md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)

        def block(x, p):
            local = attend(x, p["wq"], p["wk"], p["wv"], local_ok)
            glob = attend(x, p["wq_g"], p["wk_g"], p["wv_g"], real_key)               # a global row sees every key
            o = md.where(is_global, glob, local)
            x = md.layer_norm(x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model",
                                            o, p["wo"]), "d_model", p["ln1"])
            m = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["w_fc"]))
            return md.layer_norm(x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", m, p["w_proj"]),
                                 "d_model", p["ln2"])

        x = md.repeat(block, md.gather(wte, ids, "vocab") + wpe, blocks, "layer")
        cls = md.squeeze(md.slice_(x, "seq", 0, 1), "seq")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", cls, w_cls)
        loss = md.reduce_mean(md.cross_entropy(logits, label, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(cfg.seq // 2, cfg.seq + 1, (cfg.batch,), generator=gen)
        glob = torch.zeros(cfg.batch, cfg.seq, dtype=torch.bool)
        glob[:, 0] = True
        for b in range(cfg.batch):
            glob[b, torch.randperm(int(lengths[b]) - 1, generator=gen)[:cfg.num_global] + 1] = True
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen), "is_global": glob,
                "lengths": lengths, "label": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, {"wte": wte, "wpe": wpe, **blocks, "w_cls": w_cls}, feeds, cfg)
