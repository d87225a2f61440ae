"""A T5-style encoder-decoder written from the README and docs/ alone (a held-out model).

One embedding table shared by the encoder's input, the decoder's input and the output head
(tied, the head scaled by d_model**-0.5 as T5 does); one relative position bias table
``[rel, heads]`` (a clipped relative distance, bidirectional) gathered once outside both stacks
into the encoder's ``[heads, seq, key_seq]`` bias and the decoder's ``[heads, tgt, key_tgt]``
bias, read by every layer of both; RMSNorm without biases, no attention scaling (T5),
composite attention with the bias added (and the causal mask in the decoder), cross-attention
from the decoder to the encoder's output without bias, a relu MLP; the encoder's layers stacked
over ``enc_layer``, the decoder's over ``layer``.
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
    enc_layers: int = 2
    layers: int = 2
    seq: int = 16
    tgt: int = 12
    max_distance: int = 4
    batch: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=32, enc_layers=2, layers=2, seq=8, tgt=6,
                   max_distance=3, batch=4)


def _attn_params(prefix: str, layer: md.Dim, d_model: md.Dim, heads: md.Dim, d_head: md.Dim) -> dict:
    return {prefix + w: md.param(prefix + w, [layer, d_model, heads, d_head], fan_out=[layer.name, heads, d_head])
            for w in ("wq", "wk", "wv")} | {
        prefix + "wo": md.param(prefix + "wo", [layer, heads, d_head, d_model], fan_out=[layer.name, d_model])}


def _attention(h: md.Tensor, mem: md.Tensor, p: dict, prefix: str, q_dim: str, k_dim: str, bias, mask) -> md.Tensor:
    """T5 attention of ``h`` over ``mem`` (renamed to ``k_dim``): scores plus ``bias``, no scaling."""
    k_of = md.rename(mem, {q_dim: k_dim}) if q_dim in mem.shape.names else mem
    src = k_of.shape.names[1]
    q = md.einsum(f"batch {q_dim} d_model, d_model heads d_head -> batch {q_dim} heads d_head", h, p[prefix + "wq"])
    k = md.einsum(f"batch {src} d_model, d_model heads d_head -> batch {src} heads d_head", k_of, p[prefix + "wk"])
    v = md.einsum(f"batch {src} d_model, d_model heads d_head -> batch {src} heads d_head", k_of, p[prefix + "wv"])
    s = md.einsum(f"batch {q_dim} heads d_head, batch {src} heads d_head -> batch heads {q_dim} {src}", q, k)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = md.where(mask, s, -1e9)
    a = md.softmax(s, src)
    o = md.einsum(f"batch heads {q_dim} {src}, batch {src} heads d_head -> batch {q_dim} heads d_head", a, v)
    return md.einsum(f"batch {q_dim} heads d_head, heads d_head d_model -> batch {q_dim} d_model", o, p[prefix + "wo"])


def _mlp(h: md.Tensor, p: dict, q_dim: str) -> md.Tensor:
    h = md.relu(md.einsum(f"batch {q_dim} d_model, d_model d_ff -> batch {q_dim} d_ff", h, p["wi"]))
    return md.einsum(f"batch {q_dim} d_ff, d_ff d_model -> batch {q_dim} d_model", h, p["wo_ff"])


def _relative_ids(q: md.Dim, k: md.Dim, m: int) -> md.Tensor:
    """Clipped relative distance ``k - q`` shifted into ``[0, 2m]``, ``[k, q]`` (integer math)."""
    rel = md.arange(k) - md.arange(q)
    return md.minimum(md.maximum(rel, -m), m) + m


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, tgt = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("tgt", cfg.tgt)
    key_seq, key_tgt = md.Dim("key_seq", cfg.seq), md.Dim("key_tgt", cfg.tgt)
    d_model, heads, d_head, d_ff = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    vocab, rel = md.Dim("vocab", cfg.vocab), md.Dim("rel", 2 * cfg.max_distance + 1)
    enc_layer, layer = md.Dim("enc_layer", cfg.enc_layers), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_t5shared") as g:
        src_ids = md.input("src_ids", [batch, seq], dtype=torch.int64)
        tgt_ids = md.input("tgt_ids", [batch, tgt], dtype=torch.int64)
        labels = md.input("labels", [batch, tgt], dtype=torch.int64)
        shared = md.param("shared", [vocab, d_model], scale=1.0)
        rel_bias = md.param("rel_bias", [rel, heads], scale=0.5)
        enc = {"ln_attn": md.param("enc_ln_attn", [enc_layer, d_model], init="ones"),
               "ln_ff": md.param("enc_ln_ff", [enc_layer, d_model], init="ones"),
               **_attn_params("", enc_layer, d_model, heads, d_head),
               "wi": md.param("enc_wi", [enc_layer, d_model, d_ff], fan_out=["enc_layer", d_ff]),
               "wo_ff": md.param("enc_wo_ff", [enc_layer, d_ff, d_model], fan_out=["enc_layer", d_model])}
        dec = {"ln_self": md.param("dec_ln_self", [layer, d_model], init="ones"),
               "ln_cross": md.param("dec_ln_cross", [layer, d_model], init="ones"),
               "ln_ff": md.param("dec_ln_ff", [layer, d_model], init="ones"),
               **_attn_params("self_", layer, d_model, heads, d_head),
               **_attn_params("cross_", layer, d_model, heads, d_head),
               "wi": md.param("dec_wi", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
               "wo_ff": md.param("dec_wo_ff", [layer, d_ff, d_model], fan_out=["layer", d_model])}
        enc_ln_f, dec_ln_f = md.param("enc_ln_f", [d_model], init="ones"), md.param("dec_ln_f", [d_model], init="ones")

        # one table, two biases: [key_seq, seq, heads] and [key_tgt, tgt, heads], read by every layer
        enc_bias = md.gather(rel_bias, _relative_ids(seq, key_seq, cfg.max_distance), "rel")
        dec_bias = md.gather(rel_bias, _relative_ids(tgt, key_tgt, cfg.max_distance), "rel")
        causal = md.causal_mask(tgt, key_tgt)

        def enc_block(x, p):
            x = x + _attention(md.rms_norm(x, "d_model", p["ln_attn"]), md.rms_norm(x, "d_model", p["ln_attn"]),
                               p, "", "seq", "key_seq", enc_bias, None)
            return x + _mlp(md.rms_norm(x, "d_model", p["ln_ff"]), p, "seq")

        x = md.gather(shared, src_ids, "vocab")
        memory = md.rms_norm(md.repeat(enc_block, x, enc, "enc_layer"), "d_model", enc_ln_f)

        def dec_block(y, p):
            h = md.rms_norm(y, "d_model", p["ln_self"])
            y = y + _attention(h, h, p, "self_", "tgt", "key_tgt", dec_bias, causal)
            y = y + _attention(md.rms_norm(y, "d_model", p["ln_cross"]), memory, p, "cross_", "tgt", "seq", None, None)
            return y + _mlp(md.rms_norm(y, "d_model", p["ln_ff"]), p, "tgt")

        y = md.gather(shared, tgt_ids, "vocab")
        y = md.rms_norm(md.repeat(dec_block, y, dec, "layer"), "d_model", dec_ln_f)
        logits = md.einsum("batch tgt d_model, vocab d_model -> batch tgt vocab", y * cfg.d_model ** -0.5, shared)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tgt + 1), generator=gen)
        return {"src_ids": src, "tgt_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    # keyed by each param's own name (the attention params are named wq, self_wq, ...: under
    # another key a param would not train)
    params = {p.name: p for p in (shared, rel_bias, *enc.values(), *dec.values(), enc_ln_f, dec_ln_f)}
    return md.Model(g, loss, params, feeds, cfg)
