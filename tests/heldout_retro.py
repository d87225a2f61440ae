"""A RETRO-style decoder with chunked cross-attention, written from the README and docs/ alone (a held-out model).

RETRO (Borgeaud et al. 2022): the sequence is cut into ``chunks`` of ``clen`` tokens; for each chunk
``nbrs`` neighbour passages of ``nlen`` tokens were retrieved ahead of time. Here they arrive as an
extra input ``retrieved [batch, chunks, nbrs, nlen, d_model]`` (a frozen retriever's token
embeddings), which a trainable encoder projects and runs through one bidirectional attention layer
within each neighbour, once, before the decoder stack. Every decoder layer has causal self-attention
(fused ``md.attention``), chunked cross-attention (CCA; with ``cca_every=n`` only every n-th layer
adds it, by a constant 0/1 gate stacked over ``layer`` with the params) and a SwiGLU MLP,
pre-RMSNorm. CCA keeps causality as RETRO does: the hidden states are shifted left by ``clen - 1``
(``md.shift``), cut into chunks by ``md.rearrange``, so that the last token of chunk u and the next
``clen - 1`` tokens attend to chunk u's neighbours (one softmax over ``nbrs`` and ``nlen`` at once),
then shifted back; the first ``clen - 1`` tokens get no retrieval (the shift's zero fill, masked out
of the sum). A next-token loss over an untied head; ``batches=`` makes every input, the retrieved
neighbours too, so ``meshdsl train`` runs it on its own data.

Dims: ``batch``, ``seq`` / ``key_seq``, ``chunks``, ``cpos`` (a token within its chunk), ``nbrs``,
``nlen`` / ``klen`` (a neighbour's tokens, as queries and keys of the encoder), ``keys`` (``nbrs nlen``
merged, ``keys="merged"``), ``d_model``, ``qkv``, ``heads``, ``d_head``, ``d_ff``, ``vocab``, ``layer``.
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
    chunks: int = 4
    clen: int = 8
    nbrs: int = 2
    nlen: int = 8
    batch: int = 4
    keys: str = "two_dims"   # the softmax over [nbrs, nlen]; "merged": over one (nbrs nlen) dim
    cca_every: int = 1       # chunked cross-attention in every n-th layer (RETRO: from layer 6, every 3rd)
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=2, d_head=4, d_ff=24, layers=2, chunks=3, clen=4, nbrs=2, nlen=3,
                   batch=4)


def build(cfg: Config = Config()) -> md.Model:
    n_seq = cfg.chunks * cfg.clen
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", n_seq)
    chunks, nbrs, nlen = md.Dim("chunks", cfg.chunks), md.Dim("nbrs", cfg.nbrs), md.Dim("nlen", cfg.nlen)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    qkv = [heads, d_head]
    with md.Graph("heldout_retro") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        retrieved = md.input("retrieved", [batch, chunks, nbrs, nlen, d_model])
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        enc = {n: md.param(f"enc_{n}", [d_model, *qkv], fan_out=qkv) for n in ("q", "k", "v")}
        enc["o"] = md.param("enc_o", [*qkv, d_model], fan_out=[d_model])
        enc_norm = md.param("enc_norm", [d_model], init="ones")
        blocks = {
            "ln_sa": md.param("ln_sa", [layer, d_model], init="ones"),
            "wqkv": md.param("wqkv", [layer, md.Dim("qkv", 3), d_model, *qkv], fan_out=["layer", "qkv", *qkv]),
            "wo": md.param("wo", [layer, *qkv, d_model], fan_out=["layer", d_model]),
            "ln_ca": md.param("ln_ca", [layer, d_model], init="ones"),
            "cq": md.param("cq", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "ck": md.param("ck", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "cv": md.param("cv", [layer, d_model, *qkv], fan_out=["layer", *qkv]),
            "co": md.param("co", [layer, *qkv, d_model], fan_out=["layer", d_model]),
            "ln_ff": md.param("ln_ff", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=[vocab])
        # which layers retrieve: a constant stacked over ``layer`` with the params (1: CCA, 0: none)
        has_cca = md.constant(torch.tensor([float((i + 1) % cfg.cca_every == 0) for i in range(cfg.layers)]), [layer])

        # the neighbour encoder: once, before the stack; attention within each neighbour passage
        proj = "batch chunks nbrs nlen d_model, d_model heads d_head -> batch chunks nbrs nlen heads d_head"
        e = md.rms_norm(retrieved, "d_model", enc_norm)
        eq, ek, ev = (md.einsum(proj, e, enc[n]) for n in ("q", "k", "v"))
        eo = md.attention(eq, md.rename(ek, nlen="klen"), md.rename(ev, nlen="klen"), "nlen", "klen", "d_head",
                          causal=False)
        memory = retrieved + md.einsum("batch chunks nbrs nlen heads d_head, heads d_head d_model -> "
                                       "batch chunks nbrs nlen d_model", eo, enc["o"])
        # the first clen - 1 tokens see no neighbours: 0 there after the shift back
        retrieves = md.cast(md.greater_equal(md.arange(seq), cfg.clen - 1), torch.float32)
        scale = cfg.d_head ** -0.5

        def chunked_cross_attention(h: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            hs = md.shift(h, "seq", -(cfg.clen - 1))            # token t + clen - 1 at t: chunk u reads chunk u's neighbours
            hc = md.rearrange(hs, "batch (chunks cpos) d_model -> batch chunks cpos d_model", cpos=cfg.clen)
            q = md.einsum("batch chunks cpos d_model, d_model heads d_head -> batch chunks cpos heads d_head", hc, p["cq"])
            k = md.einsum("batch chunks nbrs nlen d_model, d_model heads d_head -> batch chunks nbrs nlen heads d_head",
                          memory, p["ck"])
            v = md.einsum("batch chunks nbrs nlen d_model, d_model heads d_head -> batch chunks nbrs nlen heads d_head",
                          memory, p["cv"])
            if cfg.keys == "merged":   # (nbrs nlen) as one key dim
                k, v = (md.rearrange(t, "batch chunks nbrs nlen heads d_head -> batch chunks (nbrs nlen) heads d_head")
                        for t in (k, v))
                k, v = md.rename(k, nbrs_nlen="keys"), md.rename(v, nbrs_nlen="keys")
                kdims = "keys"
            else:
                kdims = "nbrs nlen"
            s = md.einsum(f"batch chunks cpos heads d_head, batch chunks {kdims} heads d_head -> "
                          f"batch chunks heads cpos {kdims}", q, k) * scale
            att = md.softmax(s, kdims.split())      # one softmax over every neighbour token of the chunk
            o = md.einsum(f"batch chunks heads cpos {kdims}, batch chunks {kdims} heads d_head -> "
                          "batch chunks cpos heads d_head", att, v)
            o = md.einsum("batch chunks cpos heads d_head, heads d_head d_model -> batch chunks cpos d_model", o, p["co"])
            o = md.rename(md.rearrange(o, "batch chunks cpos d_model -> batch (chunks cpos) d_model"), chunks_cpos="seq")
            return md.shift(o, "seq", cfg.clen - 1) * retrieves

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["ln_sa"])
            qkv_ = md.einsum("batch seq d_model, qkv d_model heads d_head -> qkv batch seq heads d_head", h, p["wqkv"])
            q, k, v = (md.squeeze(md.slice_(qkv_, "qkv", i, i + 1), "qkv") for i in range(3))
            o = md.attention(q, md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq"), "seq", "key_seq", "d_head",
                             causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            x = x + chunked_cross_attention(md.rms_norm(x, "d_model", p["ln_ca"]), p) * p["has_cca"]
            h = md.rms_norm(x, "d_model", p["ln_ff"])
            f = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])) * \
                md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_down"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, {**blocks, "has_cca": has_cca}, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", lnf), lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Every input (the retrieved neighbours too, which token data does not make), rows ``rows``."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, n_seq + 1), generator=gen)
        full = {"ids": tokens[:, :-1], "labels": tokens[:, 1:],
                "retrieved": torch.randn(cfg.batch, cfg.chunks, cfg.nbrs, cfg.nlen, cfg.d_model, generator=gen)}
        return full if rows is None else {k: v[rows] for k, v in full.items()}

    params = {"wte": wte, **{f"enc_{n}": t for n, t in enc.items()}, "enc_norm": enc_norm, **blocks, "lnf": lnf,
              "lm_head": lm_head}
    return md.Model(g, loss, params, batches=batches, config=cfg, logits=logits)
