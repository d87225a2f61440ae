"""A Falcon-style decoder, written from the README and docs/ alone (a held-out model).

Each layer is ONE parallel block: attention and the MLP both read the same normed input and
their outputs are added to the residual together (``x + attn(n) + mlp(n)``). ``norm="shared"``
(Falcon-7B) makes ``n`` by one layer norm; ``norm="two"`` (Falcon-40B) by two, one per branch.
Multi-query attention: ``heads`` query heads, ONE key/value head (k and v have no ``heads``
dim); rotary positions from cos/sin tables built once before the stack; no biases; gelu MLP;
a final layer norm and an untied head.

Legend: b batch, s seq, t key_seq, d d_model, h heads, e d_head, f d_ff.
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
    d_ff: int = 128
    layers: int = 2
    seq: int = 16
    batch: int = 4
    norm: str = "shared"      # or "two"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=32, layers=2, seq=8, batch=4)


def _rotary(cfg: Config, s: md.Dim, e: md.Dim):
    half = cfg.d_head // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(cfg.seq, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=1)                       # [seq, d_head]: (first half, second half)
    return md.constant(torch.cos(ang), [s, e]), md.constant(torch.sin(ang), [s, e])


def _rotate(x, cos, sin, e: int, seq_name: str):
    """x * cos + rotate_half(x) * sin, the tables' ``seq`` renamed to x's position dim."""
    if seq_name != "seq":
        cos, sin = md.rename(cos, seq=seq_name), md.rename(sin, seq=seq_name)
    x1, x2 = md.slice_(x, "d_head", 0, e // 2), md.slice_(x, "d_head", e // 2, e)
    return x * cos + md.concat([-x2, x1], "d_head") * sin


def build(cfg: Config = Config()) -> md.Model:
    if cfg.norm not in ("shared", "two"):
        raise ValueError(f"norm must be 'shared' or 'two', not {cfg.norm!r}")
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, L = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_falcon") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = {
            "ln": md.param("ln", [L, d], init="ones"), "ln_b": md.param("ln_b", [L, d], init="zeros"),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, d, e], fan_out=["layer", "d_head"]),
            "wv": md.param("wv", [L, d, e], fan_out=["layer", "d_head"]),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]),
            "w_up": md.param("w_up", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [L, f, d], fan_out=["layer", "d_model"]),
        }
        if cfg.norm == "two":
            p["ln_mlp"] = md.param("ln_mlp", [L, d], init="ones")
            p["ln_mlp_b"] = md.param("ln_mlp_b", [L, d], init="zeros")
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        head = md.param("head", [d, v], fan_out=["vocab"])
        cos, sin = _rotary(cfg, s, e)

        def block(x, p):
            n = md.layer_norm(x, "d_model", p["ln"], p["ln_b"])
            m = n if cfg.norm == "shared" else md.layer_norm(x, "d_model", p["ln_mlp"], p["ln_mlp_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wq"])
            nk = md.rename(n, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", nk, p["wk"])
            val = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", nk, p["wv"])
            q, k = _rotate(q, cos, sin, cfg.d_head, "seq"), _rotate(k, cos, sin, cfg.d_head, "key_seq")
            o = md.attention(q, k, val, "seq", "key_seq", "d_head", causal=True)
            attn = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            mlp = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model",
                            md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", m, p["w_up"])),
                            p["w_down"])
            return x + attn + mlp

        x = md.repeat(block, md.gather(wte, ids, "vocab"), p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.layer_norm(x, "d_model", lnf, lnf_b), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    params = {"wte": wte, **p, "lnf": lnf, "lnf_b": lnf_b, "head": head}
    return md.Model(graph, loss, params, feeds, cfg, logits=logits)
