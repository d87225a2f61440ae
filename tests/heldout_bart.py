"""A BART/Whisper-style encoder-decoder, written from the README and docs/ alone.

The encoder (post-norm, as BART) reads source tokens with a padding mask; the decoder
(pre-norm, as Whisper) runs causal self-attention, then cross-attention over the encoder's
output, then a gelu MLP. Both stacks are ``md.repeat``s over the same ``layer`` dim, so
``layer:stage`` pipelines both on one stage axis. Learned positions per side; the decoder's
token embedding is the source embedding and the LM head (tied).
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
    layers: int = 2          # per stack: the encoder's and the decoder's
    enc_layer: str = "layer"  # the encoder stack's layer dim ("enc_layer": 'layer:stage' pipelines the decoder only)
    src: int = 16
    tgt: int = 12
    batch: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, src=6, tgt=5, batch=4)


def _masked_attention(q, k, v, key_mask, query_dim: str, key_dim: str, d_head: int):
    """softmax(q . k / sqrt(d_head), masked by ``key_mask`` [batch, key]) . v, the composite."""
    scores = md.einsum(f"batch {query_dim} heads d_head, batch {key_dim} heads d_head "
                       f"-> batch heads {query_dim} {key_dim}", q, k)
    scores = md.where(md.greater(key_mask, 0.5), scores * (d_head ** -0.5), -1e9)
    probs = md.softmax(scores, key_dim)
    return md.einsum(f"batch heads {query_dim} {key_dim}, batch {key_dim} heads d_head "
                     f"-> batch {query_dim} heads d_head", probs, v)


def build(cfg: Config = Config()) -> md.Model:
    B, V, D = md.Dim("batch", cfg.batch), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    L, LE = md.Dim("layer", cfg.layers), md.Dim(cfg.enc_layer, cfg.layers)
    S, SK = md.Dim("src", cfg.src), md.Dim("src_k", cfg.src)
    T, TK = md.Dim("tgt", cfg.tgt), md.Dim("tgt_k", cfg.tgt)
    sd = cfg.d_model ** -0.5
    with md.Graph("bart") as g:
        src_ids = md.input("src_ids", [B, S], dtype=torch.int64)
        src_mask = md.input("src_mask", [B, S])          # 1.0 real token, 0.0 padding
        tgt_ids = md.input("tgt_ids", [B, T], dtype=torch.int64)
        labels = md.input("labels", [B, T], dtype=torch.int64)

        wte = md.param("wte", [V, D], scale=0.5)
        pos_src = md.param("pos_src", [S, D], scale=0.1)
        pos_tgt = md.param("pos_tgt", [T, D], scale=0.1)
        enc = {n: md.param(f"enc_{n}", [LE, D, H, E], scale=sd) for n in ("wq", "wk", "wv")}
        enc["wo"] = md.param("enc_wo", [LE, H, E, D], scale=(cfg.heads * cfg.d_head) ** -0.5)
        enc["w1"] = md.param("enc_w1", [LE, D, F], scale=sd)
        enc["w2"] = md.param("enc_w2", [LE, F, D], scale=cfg.d_ff ** -0.5)
        for n in ("ln1", "ln2"):
            enc[n] = md.param(f"enc_{n}", [LE, D], init="ones")
            enc[n + "_b"] = md.param(f"enc_{n}_b", [LE, D], init="zeros")
        dec = {}
        for part in ("self", "cross"):
            for n in ("wq", "wk", "wv"):
                dec[f"{part}_{n}"] = md.param(f"dec_{part}_{n}", [L, D, H, E], scale=sd)
            dec[f"{part}_wo"] = md.param(f"dec_{part}_wo", [L, H, E, D], scale=(cfg.heads * cfg.d_head) ** -0.5)
        dec["w1"] = md.param("dec_w1", [L, D, F], scale=sd)
        dec["w2"] = md.param("dec_w2", [L, F, D], scale=cfg.d_ff ** -0.5)
        for n in ("ln1", "ln2", "ln3"):
            dec[n] = md.param(f"dec_{n}", [L, D], init="ones")
        ln_enc, ln_dec = md.param("ln_enc", [D], init="ones"), md.param("ln_dec", [D], init="ones")

        key_mask = md.rename(src_mask, {"src": "src_k"})

        def enc_block(h, p):
            q = md.einsum("batch src d_model, d_model heads d_head -> batch src heads d_head", h, p["wq"])
            k = md.rename(md.einsum("batch src d_model, d_model heads d_head -> batch src heads d_head", h, p["wk"]),
                          {"src": "src_k"})
            v = md.rename(md.einsum("batch src d_model, d_model heads d_head -> batch src heads d_head", h, p["wv"]),
                          {"src": "src_k"})
            a = _masked_attention(q, k, v, key_mask, "src", "src_k", cfg.d_head)
            h = md.layer_norm(h + md.einsum("batch src heads d_head, heads d_head d_model -> batch src d_model", a, p["wo"]),
                              "d_model", p["ln1"], p["ln1_b"])
            f = md.gelu(md.einsum("batch src d_model, d_model d_ff -> batch src d_ff", h, p["w1"]))
            f = md.einsum("batch src d_ff, d_ff d_model -> batch src d_model", f, p["w2"])
            return md.layer_norm(h + f, "d_model", p["ln2"], p["ln2_b"])

        x = md.gather(wte, src_ids, "vocab") + pos_src
        memory = md.layer_norm(md.repeat(enc_block, x, enc, cfg.enc_layer, remat=cfg.remat), "d_model", ln_enc)
        mem_k = md.rename(memory, {"src": "src_k"})

        def dec_block(h, p):
            n = md.layer_norm(h, "d_model", p["ln1"])
            q = md.einsum("batch tgt d_model, d_model heads d_head -> batch tgt heads d_head", n, p["self_wq"])
            k = md.rename(md.einsum("batch tgt d_model, d_model heads d_head -> batch tgt heads d_head", n, p["self_wk"]),
                          {"tgt": "tgt_k"})
            v = md.rename(md.einsum("batch tgt d_model, d_model heads d_head -> batch tgt heads d_head", n, p["self_wv"]),
                          {"tgt": "tgt_k"})
            a = md.attention(q, k, v, "tgt", "tgt_k", "d_head", causal=True)
            h = h + md.einsum("batch tgt heads d_head, heads d_head d_model -> batch tgt d_model", a, p["self_wo"])
            n = md.layer_norm(h, "d_model", p["ln2"])
            q = md.einsum("batch tgt d_model, d_model heads d_head -> batch tgt heads d_head", n, p["cross_wq"])
            k = md.einsum("batch src_k d_model, d_model heads d_head -> batch src_k heads d_head", mem_k, p["cross_wk"])
            v = md.einsum("batch src_k d_model, d_model heads d_head -> batch src_k heads d_head", mem_k, p["cross_wv"])
            a = _masked_attention(q, k, v, key_mask, "tgt", "src_k", cfg.d_head)
            h = h + md.einsum("batch tgt heads d_head, heads d_head d_model -> batch tgt d_model", a, p["cross_wo"])
            n = md.layer_norm(h, "d_model", p["ln3"])
            f = md.gelu(md.einsum("batch tgt d_model, d_model d_ff -> batch tgt d_ff", n, p["w1"]))
            return h + md.einsum("batch tgt d_ff, d_ff d_model -> batch tgt d_model", f, p["w2"])

        y = md.gather(wte, tgt_ids, "vocab") + pos_tgt
        y = md.layer_norm(md.repeat(dec_block, y, dec, "layer", remat=cfg.remat), "d_model", ln_dec)
        logits = md.einsum("batch tgt d_model, vocab d_model -> batch tgt vocab", y, wte)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    params = {"wte": wte, "pos_src": pos_src, "pos_tgt": pos_tgt, "ln_enc": ln_enc, "ln_dec": ln_dec,
              **{t.name: t for t in enc.values()}, **{t.name: t for t in dec.values()}}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(1, cfg.vocab, (cfg.batch, cfg.src), generator=gen)
        lengths = torch.randint(cfg.src // 2, cfg.src + 1, (cfg.batch,), generator=gen)
        mask = (torch.arange(cfg.src)[None, :] < lengths[:, None]).float()
        tgt = torch.randint(1, cfg.vocab, (cfg.batch, cfg.tgt + 1), generator=gen)
        return {"src_ids": src * mask.long(), "src_mask": mask, "tgt_ids": tgt[:, :-1], "labels": tgt[:, 1:]}

    return md.Model(g, loss, params, feeds, cfg, logits=None)
