"""A Mixtral-style MoE decoder in the reference code's names, written from the README and docs/
alone (a held-out model: the user's own dim names).

Dims: ``bsz``, ``seqlen`` (``keylen`` the keys), ``dim``, ``n_heads``, ``head_dim``,
``hidden_dim`` (each expert's SwiGLU width), ``e`` (the experts), ``choice`` (the
``experts_per_tok`` picks), ``vocab``, ``n_layers`` (the stack of ``md.repeat``). Pre-norm
RMSNorm blocks: causal fused attention, then a routed SwiGLU MoE: the router's softmax over
``e``, the top ``experts_per_tok`` experts of each token (``md.top_k``, their gates renormalised
to sum to 1, the others 0), every expert run densely on every token and the outputs mixed by
those gates (no capacity, no drops). The loss is the mean next-token cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    n_heads: int = 4
    hidden_dim: int = 128
    num_experts: int = 8
    experts_per_tok: int = 2
    n_layers: int = 2
    seqlen: int = 32
    bsz: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, dim=8, n_heads=2, hidden_dim=6, num_experts=4, experts_per_tok=2,
                   n_layers=2, seqlen=8, bsz=4)


TOK = "bsz seqlen"


def build(cfg: Config = Config()) -> md.Model:
    hd = cfg.dim // cfg.n_heads
    B, S, D = md.Dim("bsz", cfg.bsz), md.Dim("seqlen", cfg.seqlen), md.Dim("dim", cfg.dim)
    NH, HD, HID = md.Dim("n_heads", cfg.n_heads), md.Dim("head_dim", hd), md.Dim("hidden_dim", cfg.hidden_dim)
    E, V, L = md.Dim("e", cfg.num_experts), md.Dim("vocab", cfg.vocab), md.Dim("n_layers", cfg.n_layers)
    with md.Graph("moe_e") as g:
        tokens = md.input("tokens", [B, S], dtype=torch.int64)
        targets = md.input("targets", [B, S], dtype=torch.int64)
        tok_emb = md.param("tok_embeddings", [V, D], scale=0.02)
        fo = lambda *d: ["n_layers", *d]
        layers = {
            "attention_norm": md.param("attention_norm", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, NH, HD], fan_out=fo("n_heads", "head_dim")),
            "wk": md.param("wk", [L, D, NH, HD], fan_out=fo("n_heads", "head_dim")),
            "wv": md.param("wv", [L, D, NH, HD], fan_out=fo("n_heads", "head_dim")),
            "wo": md.param("wo", [L, NH, HD, D], fan_out=fo("dim")),
            "ffn_norm": md.param("ffn_norm", [L, D], init="ones"),
            "gate": md.param("gate", [L, D, E], fan_out=fo("e")),
            "w1": md.param("w1", [L, E, D, HID], fan_out=fo("e", "hidden_dim")),
            "w3": md.param("w3", [L, E, D, HID], fan_out=fo("e", "hidden_dim")),
            "w2": md.param("w2", [L, E, HID, D], fan_out=fo("e", "dim")),
        }
        norm = md.param("norm", [D], init="ones")
        output = md.param("output", [D, V], fan_out=["vocab"])

        def moe(x, p):
            probs = md.softmax(md.einsum(f"{TOK} dim, dim e -> {TOK} e", x, p["gate"]), "e")
            _, idx = md.top_k(probs, "e", cfg.experts_per_tok, "choice")
            picked = md.reduce_sum(md.one_hot(idx, E), "choice")                 # [bsz seqlen e], 0/1
            gates = probs * picked
            gates = gates / md.reduce_sum(gates, "e")
            up = md.einsum(f"{TOK} dim, e dim hidden_dim -> {TOK} e hidden_dim", x, p["w1"])
            lin = md.einsum(f"{TOK} dim, e dim hidden_dim -> {TOK} e hidden_dim", x, p["w3"])
            y = md.einsum(f"{TOK} e hidden_dim, e hidden_dim dim -> {TOK} e dim", md.silu(up) * lin, p["w2"])
            return md.reduce_sum(y * gates, "e")

        def block(x, p):
            a = md.rms_norm(x, "dim", p["attention_norm"])
            q = md.einsum(f"{TOK} dim, dim n_heads head_dim -> {TOK} n_heads head_dim", a, p["wq"])
            k = md.rename(md.einsum(f"{TOK} dim, dim n_heads head_dim -> {TOK} n_heads head_dim", a, p["wk"]),
                          seqlen="keylen")
            v = md.rename(md.einsum(f"{TOK} dim, dim n_heads head_dim -> {TOK} n_heads head_dim", a, p["wv"]),
                          seqlen="keylen")
            o = md.attention(q, k, v, "seqlen", "keylen", "head_dim", causal=True)
            x = x + md.einsum(f"{TOK} n_heads head_dim, n_heads head_dim dim -> {TOK} dim", o, p["wo"])
            return x + moe(md.rms_norm(x, "dim", p["ffn_norm"]), p)

        h = md.repeat(block, md.gather(tok_emb, tokens, "vocab"), layers, "n_layers")
        logits = md.einsum(f"{TOK} dim, dim vocab -> {TOK} vocab", md.rms_norm(h, "dim", norm), output)
        loss = md.reduce_mean(md.cross_entropy(logits, targets, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.bsz, cfg.seqlen + 1), generator=gen)
        return {"tokens": t[:, :-1], "targets": t[:, 1:]}

    return md.Model(g, loss, {"tok_embeddings": tok_emb, **layers, "norm": norm, "output": output}, feeds, cfg,
                    logits=logits)
