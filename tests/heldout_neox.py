"""A GPT-NeoX / GPT-J-style decoder written from the README and docs/ alone (a held-out model).

Parallel residual (``x + attn(ln1(x)) + mlp(ln2(x))``), partial rotary embeddings (the first
``rotary`` features of each head turn, the rest pass through), LayerNorm with a bias, biases on
every projection, a gelu MLP, an untied LM head, attention written out as einsums, a
``where`` on a causal mask and a softmax, blocks under ``md.repeat``.
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
    rotary: int = 4           # features of each head that the rotary embedding turns (even, <= d_head)
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, rotary=2, d_ff=32, layers=2, seq=8, batch=4)


def rotary_tables(pos: md.Dim, half: int) -> tuple[md.Tensor, md.Tensor]:
    inv_freq = md.constant(10000.0 ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
    angles = md.cast(md.arange(pos), torch.float32) * inv_freq
    return md.cos(angles), md.sin(angles)


def partial_rotary(x: md.Tensor, cos: md.Tensor, sin: md.Tensor, cfg: Config) -> md.Tensor:
    half = cfg.rotary // 2
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, cfg.rotary)
    rest = md.slice_(x, "d_head", cfg.rotary, cfg.d_head)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_neox") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.02)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "bq": md.param("bq", [layer, heads, d_head], scale=0.02),
            "bk": md.param("bk", [layer, heads, d_head], scale=0.02),
            "bv": md.param("bv", [layer, heads, d_head], scale=0.02),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[d_model]),
            "bo": md.param("bo", [layer, d_model], scale=0.02),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=[d_ff]),
            "b_fc": md.param("b_fc", [layer, d_ff], scale=0.02),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=[d_model]),
            "b_proj": md.param("b_proj", [layer, d_model], scale=0.02),
        }
        lnf, lnf_b = md.param("lnf", [d_model], init="ones"), md.param("lnf_b", [d_model], init="zeros")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=[vocab])

        cos_q, sin_q = rotary_tables(seq, cfg.rotary // 2)
        cos_k, sin_k = rotary_tables(key_seq, cfg.rotary // 2)
        mask = md.causal_mask(seq, key_seq)

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"]) + p["bq"]
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"]) + p["bk"]
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"]) + p["bv"]
            q = partial_rotary(q, cos_q, sin_q, cfg)
            k = partial_rotary(md.rename(k, seq="key_seq"), cos_k, sin_k, cfg)
            v = md.rename(v, seq="key_seq")
            scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(mask, scores * cfg.d_head ** -0.5, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            attn = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"]) + p["bo"]
            h2 = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h2, p["w_fc"]) + p["b_fc"])
            mlp = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_proj"]) + p["b_proj"]
            return x + attn + mlp                                   # parallel residual

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        x = md.layer_norm(x, "d_model", lnf, lnf_b)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"wte": wte, **blocks, "lnf": lnf, "lnf_b": lnf_b, "lm_head": lm_head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
