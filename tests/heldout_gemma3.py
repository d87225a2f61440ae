"""A Gemma-3-style decoder, written from the README and docs/ alone (a held-out model).

Local (sliding-window) and global attention layers alternate, ``local`` local layers to each
global one (Gemma 3's 5:1; tiny 2:1). A ``md.repeat`` shares one block over its layers, so the
pattern is a repeat over ``blk`` of one block made of ``local`` local layers and one global layer,
each sub-layer with its own params stacked over ``blk``. A layer: grouped-query attention (q
``[batch, seq, kv_heads, group, d_head]``), RMSNorm on q and k over ``d_head`` (QK-norm), rotary
embeddings (base 10k on local layers, 1M on global ones, two tables made once outside the stack),
``md.attention(..., window=w)`` on local layers and plain causal attention on global ones, a
GeGLU MLP, and four norms per layer (pre and post of attention and of the MLP). The embedding
is scaled by ``sqrt(d_model)`` and tied to the LM head; the logits are soft-capped,
``cap * tanh(logits / cap)``; the next-token cross entropy.

Legend: b batch, s seq, k key_seq, d d_model, n kv_heads, g group, e d_head, t two, h half,
f d_ff, v vocab, B blk (a local...local+global block).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    kv_heads: int = 2
    group: int = 2
    d_head: int = 32
    d_ff: int = 384
    blocks: int = 2
    local: int = 5
    window: int = 16
    seq: int = 64
    batch: int = 8
    cap: float = 30.0
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, kv_heads=2, group=2, d_head=4, d_ff=16, blocks=2, local=2, window=3,
                   seq=12, batch=2, cap=2.0)


def rope_tables(cfg: Config, s: md.Dim, theta: float):
    """Cosines ``[seq, half]`` and signed sines ``[seq, two, half]`` of the rotate-half form."""
    t, h = md.Dim("two", 2), md.Dim("half", cfg.d_head // 2)
    inv = 1.0 / theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
    ang = md.arange(s, torch.float32) * md.constant(inv.float(), [h])
    return md.cos(ang), md.sin(ang) * md.constant(torch.tensor([-1.0, 1.0]), [t])


def rotate(x, cos, sin):
    names = " ".join(x.shape.names[:-1])
    halves = md.rearrange(x, f"{names} (two half) -> {names} two half", two=2)
    return md.reshape(halves * cos + md.roll(halves, "two", 1) * sin, x.shape)


def layer_params(name: str, B, d, n, g, e, f) -> dict:
    ones = {k: md.param(f"{name}_{k}", [B, d], init="ones") for k in ("pre_attn", "post_attn", "pre_mlp", "post_mlp")}
    return {**ones,
            "q_norm": md.param(f"{name}_q_norm", [B, e], init="ones"),
            "k_norm": md.param(f"{name}_k_norm", [B, e], init="ones"),
            "wq": md.param(f"{name}_wq", [B, d, n, g, e], fan_out=[B, n, g, e]),
            "wk": md.param(f"{name}_wk", [B, d, n, e], fan_out=[B, n, e]),
            "wv": md.param(f"{name}_wv", [B, d, n, e], fan_out=[B, n, e]),
            "wo": md.param(f"{name}_wo", [B, n, g, e, d], fan_out=[B, d]),
            "w_gate": md.param(f"{name}_w_gate", [B, d, f], fan_out=[B, f]),
            "w_up": md.param(f"{name}_w_up", [B, d, f], fan_out=[B, f]),
            "w_down": md.param(f"{name}_w_down", [B, f, d], fan_out=[B, d])}


def layer(x, p, rope, window):
    """One Gemma layer: pre/post-normed attention (QK-norm, RoPE, GQA) and pre/post-normed GeGLU."""
    z = md.rms_norm(x, "d_model", p["pre_attn"])
    q = md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head", z, p["wq"])
    kv = "batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head"
    q = rotate(md.rms_norm(q, "d_head", p["q_norm"]), *rope)
    k = md.rename(rotate(md.rms_norm(md.einsum(kv, z, p["wk"]), "d_head", p["k_norm"]), *rope), seq="key_seq")
    v = md.rename(md.einsum(kv, z, p["wv"]), seq="key_seq")
    y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, window=window)
    y = md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model", y, p["wo"])
    x = x + md.rms_norm(y, "d_model", p["post_attn"])
    z = md.rms_norm(x, "d_model", p["pre_mlp"])
    up = "batch seq d_model, d_model d_ff -> batch seq d_ff"
    u = md.gelu(md.einsum(up, z, p["w_gate"])) * md.einsum(up, z, p["w_up"])
    y = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])
    return x + md.rms_norm(y, "d_model", p["post_mlp"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, g_, e = md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group), md.Dim("d_head", cfg.d_head)
    f, v, B = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("blk", cfg.blocks)
    with md.Graph("heldout_gemma3") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        emb = md.param("emb", [v, d], scale=1.0)
        norm_f = md.param("norm_f", [d], init="ones")
        subs = [f"local{i}" for i in range(cfg.local)] + ["global"]
        stacked = {}
        for name in subs:
            stacked.update({f"{name}_{k}": t for k, t in layer_params(name, B, d, n, g_, e, f).items()})
        local_rope, global_rope = rope_tables(cfg, s, 10_000.0), rope_tables(cfg, s, 1_000_000.0)

        def block(x, p):
            for name in subs:
                q = {k[len(name) + 1:]: t for k, t in p.items() if k.startswith(name + "_")}
                loc = name != "global"
                x = layer(x, q, local_rope if loc else global_rope, cfg.window if loc else None)
            return x

        x = md.gather(emb, ids, "vocab") * cfg.d_model ** 0.5
        x = md.repeat(block, x, stacked, B, remat=cfg.remat)
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, emb)
        logits = cfg.cap * md.tanh(logits / cfg.cap)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}

    return md.Model(g, loss, {"emb": emb, "norm_f": norm_f, **stacked}, feeds, cfg, logits=logits)
