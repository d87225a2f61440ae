"""An encoder-decoder whose cross-attention keys and values are computed once, for every decoder
layer, before the decoder stack (a held-out model written from the README and docs/ alone).

The encoder: ``enc_layers`` post-norm blocks (bidirectional fused attention over ``src``, a relu
MLP) under ``md.repeat`` over ``enc_layer``. Then the decoder's cross-attention cache: one einsum
of the encoder's output with the stacked cross-attention weights gives every decoder layer's keys
and values at once, ``[layer, batch, src, heads, d_head]``, and the decoder's ``md.repeat`` takes
them as stacked per-layer tensors beside its params (each layer reads its own slice, as an
inference server's cross-attention KV cache holds them). Each decoder block: causal self-attention,
cross-attention against its cached keys and values (a padding mask on the source from fed
lengths, in a composite attention), a gelu MLP, pre-LayerNorm. Embeddings are shared by the source,
the target and the head (tied), with learned position tables for both sides.
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
    src: int = 12
    seq: int = 8
    batch: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=2, d_head=4, d_ff=24, enc_layers=2, layers=2, src=6, seq=5, batch=4)


PROJ = "batch {s} d_model, d_model heads d_head -> batch {s} heads d_head"
OUT = "batch {s} heads d_head, heads d_head d_model -> batch {s} d_model"


def build(cfg: Config = Config()) -> md.Model:
    batch, src, src_k = md.Dim("batch", cfg.batch), md.Dim("src", cfg.src), md.Dim("src_key", cfg.src)
    seq = md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab)
    enc_layer, layer = md.Dim("enc_layer", cfg.enc_layers), md.Dim("layer", cfg.layers)

    def attn_params(prefix, L):
        return {f"{prefix}{n}": md.param(f"{prefix}{n}", [L, d_model, heads, d_head], fan_out=[L.name, heads, d_head])
                for n in ("wq", "wk", "wv")} | {
            f"{prefix}wo": md.param(f"{prefix}wo", [L, heads, d_head, d_model], fan_out=[L.name, d_model])}

    def mlp_params(prefix, L):
        return {f"{prefix}w1": md.param(f"{prefix}w1", [L, d_model, d_ff], fan_out=[L.name, d_ff]),
                f"{prefix}w2": md.param(f"{prefix}w2", [L, d_ff, d_model], fan_out=[L.name, d_model])}

    def norm_params(prefix, L, n):
        return {f"{prefix}ln{i}{b}": md.param(f"{prefix}ln{i}{b}", [L, d_model], init="zeros" if b else "ones")
                for i in range(n) for b in ("", "_b")}

    with md.Graph("heldout_xcache") as g:
        src_ids = md.input("src_ids", [batch, src], dtype=torch.int64)
        src_len = md.input("src_len", [batch], dtype=torch.int64)
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        pos_src, pos_tgt = md.param("pos_src", [src, d_model], scale=0.1), md.param("pos_tgt", [seq, d_model], scale=0.1)
        enc = {**attn_params("e_", enc_layer), **mlp_params("e_", enc_layer), **norm_params("e_", enc_layer, 2)}
        dec = {**attn_params("s_", layer), **mlp_params("d_", layer), **norm_params("d_", layer, 3),
               "c_wq": md.param("c_wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
               "c_wo": md.param("c_wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model])}
        c_wk = md.param("c_wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head])
        c_wv = md.param("c_wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head])
        lnf, lnf_b = md.param("lnf", [d_model], init="ones"), md.param("lnf_b", [d_model], init="zeros")
        src_valid = md.less(md.arange(src_k), src_len)                              # [src_key, batch]

        def mlp(h, p, pre):
            s = h.shape.names[1]   # src or seq
            u = md.gelu(md.einsum(f"batch {s} d_model, d_model d_ff -> batch {s} d_ff", h, p[pre + "w1"]))
            return md.einsum(f"batch {s} d_ff, d_ff d_model -> batch {s} d_model", u, p[pre + "w2"])

        def enc_block(x, p):
            q = md.einsum(PROJ.format(s="src"), x, p["e_wq"])
            k = md.rename(md.einsum(PROJ.format(s="src"), x, p["e_wk"]), src="src_key")
            v = md.rename(md.einsum(PROJ.format(s="src"), x, p["e_wv"]), src="src_key")
            s = md.einsum("batch src heads d_head, batch src_key heads d_head -> batch heads src src_key", q, k) * cfg.d_head ** -0.5
            att = md.softmax(md.where(src_valid, s, -1e9), "src_key")
            o = md.einsum("batch heads src src_key, batch src_key heads d_head -> batch src heads d_head", att, v)
            x = md.layer_norm(x + md.einsum(OUT.format(s="src"), o, p["e_wo"]), "d_model", p["e_ln0"], p["e_ln0_b"])
            return md.layer_norm(x + mlp(x, p, "e_"), "d_model", p["e_ln1"], p["e_ln1_b"])

        memory = md.repeat(enc_block, md.gather(wte, src_ids, "vocab") + pos_src, enc, "enc_layer")
        # the cross-attention cache: every decoder layer's keys and values, made once from the memory
        kv_eq = "batch src d_model, layer d_model heads d_head -> layer batch src heads d_head"
        cache = {"c_k": md.rename(md.einsum(kv_eq, memory, c_wk), src="src_key"),
                 "c_v": md.rename(md.einsum(kv_eq, memory, c_wv), src="src_key")}

        def dec_block(x, p):
            h = md.layer_norm(x, "d_model", p["d_ln0"], p["d_ln0_b"])
            q = md.einsum(PROJ.format(s="seq"), h, p["s_wq"])
            k = md.rename(md.einsum(PROJ.format(s="seq"), h, p["s_wk"]), seq="key_seq")
            v = md.rename(md.einsum(PROJ.format(s="seq"), h, p["s_wv"]), seq="key_seq")
            x = x + md.einsum(OUT.format(s="seq"), md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True), p["s_wo"])
            h = md.layer_norm(x, "d_model", p["d_ln1"], p["d_ln1_b"])
            q = md.einsum(PROJ.format(s="seq"), h, p["c_wq"])
            s = md.einsum("batch seq heads d_head, batch src_key heads d_head -> batch heads seq src_key", q, p["c_k"])
            att = md.softmax(md.where(src_valid, s * cfg.d_head ** -0.5, -1e9), "src_key")
            o = md.einsum("batch heads seq src_key, batch src_key heads d_head -> batch seq heads d_head", att, p["c_v"])
            x = x + md.einsum(OUT.format(s="seq"), o, p["c_wo"])
            return x + mlp(md.layer_norm(x, "d_model", p["d_ln2"], p["d_ln2_b"]), p, "d_")

        x = md.repeat(dec_block, md.gather(wte, ids, "vocab") + pos_tgt, {**dec, **cache}, "layer")
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.layer_norm(x, "d_model", lnf, lnf_b), wte)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tgt = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"src_ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.src), generator=gen),
                "src_len": torch.randint(1, cfg.src + 1, (cfg.batch,), generator=gen),
                "ids": tgt[:, :-1], "labels": tgt[:, 1:]}

    params = {"wte": wte, "pos_src": pos_src, "pos_tgt": pos_tgt, **enc, **dec, "c_wk": c_wk, "c_wv": c_wv,
              "lnf": lnf, "lnf_b": lnf_b}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
