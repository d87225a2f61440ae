"""A GPT-J / Falcon-style decoder written from the README and docs/ alone (a held-out model).

Each block is *parallel*: one LayerNorm feeds both the attention and the MLP, and both
branches add to the residual at once (``x + attn(ln(x)) + mlp(ln(x))``). The rotary embedding
turns only the first ``rot_dims`` features of each head (partial rotary, GPT-J's
``rotary_dim``), in the interleaved form (features 2i and 2i+1 are a pair, GPT-J's
``rotate_every_two``): q and k are cut by ``md.slice_`` along ``d_head``, the rotated part
rearranged into ``(half two)`` pairs, and joined back by ``md.concat``. The attention is the
fused ``md.attention``; the MLP is a gelu MLP with biases; the LM head is untied and has a
bias (GPT-J's). ``multi_query=True`` makes it Falcon-7B-like: one key/value head shared by
every query head (q ``[batch, seq, heads, d_head]`` against k, v ``[batch, key_seq, d_head]``).
``weight_norm=True`` reparametrises the MLP's output projection inside the block (Salimans &
Kingma's weight normalisation, ``g * v / ||v||`` per output feature, the norm over ``d_ff``):
math on the layer's weights alone, whose gradient sums over the micro-batches.
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
    rot_dims: int = 4
    d_ff: int = 128
    layers: int = 2
    seq: int = 16
    batch: int = 4
    multi_query: bool = False
    weight_norm: bool = False
    rope_theta: float = 10000.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=16, heads=4, d_head=8, rot_dims=4, d_ff=32, layers=4, seq=8, batch=4)


def rotary_tables(cfg: Config, seq: md.Dim):
    """cos [seq, half] and signed sin [seq, half, two] for the rot_dims / 2 frequencies."""
    half, two = md.Dim("half", cfg.rot_dims // 2), md.Dim("two", 2)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rot_dims, 2, dtype=torch.float64) / cfg.rot_dims)
    ang = md.arange(seq, torch.float32) * md.constant(inv.to(torch.float32), [half])
    return md.cos(ang), md.sin(ang) * md.constant(torch.tensor([-1.0, 1.0]), [two])


def partial_rotate(x: md.Tensor, cos, sin, cfg: Config) -> md.Tensor:
    """Rotate the first rot_dims features of d_head (interleaved pairs), keep the rest."""
    e = x.shape["d_head"].size
    rot, rest = md.slice_(x, "d_head", 0, cfg.rot_dims), md.slice_(x, "d_head", cfg.rot_dims, e)
    names = " ".join(n for n in rot.shape.names if n != "d_head")
    pairs = md.rearrange(rot, f"{names} (half two) -> {names} half two", two=2)
    turned = pairs * cos + md.roll(pairs, "two", 1) * sin      # (x0 cos - x1 sin, x1 cos + x0 sin)
    back = md.rename(md.rearrange(turned, f"{names} half two -> {names} (half two)"), half_two="d_head")
    return md.concat([back, rest], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    kv = [layer, d_model, d_head] if cfg.multi_query else [layer, d_model, heads, d_head]
    kv_eq = "batch seq d_model, d_model d_head -> batch seq d_head" if cfg.multi_query else \
        "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
    with md.Graph("heldout_gptj") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        blocks = {
            "ln": md.param("ln", [layer, d_model], init="ones"),
            "ln_b": md.param("ln_b", [layer, d_model], init="zeros"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", kv, fan_out=[n for n in kv if n.name != "d_model"]),
            "wv": md.param("wv", kv, fan_out=[n for n in kv if n.name != "d_model"]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "w_in": md.param("w_in", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "b_in": md.param("b_in", [layer, d_ff], init="zeros"),
            "w_out": md.param("w_out", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "b_out": md.param("b_out", [layer, d_model], init="zeros"),
            **({"g_out": md.param("g_out", [layer, d_model], init="ones")} if cfg.weight_norm else {}),
        }
        lnf, lnf_b = md.param("lnf", [d_model], init="ones"), md.param("lnf_b", [d_model], init="zeros")
        lm_head = md.param("lm_head", [d_model, vocab], fan_out=[vocab])
        lm_b = md.param("lm_b", [vocab], init="zeros")
        cos, sin = rotary_tables(cfg, seq)

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["ln"], p["ln_b"])
            q = partial_rotate(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"]),
                               cos, sin, cfg)
            k = md.rename(partial_rotate(md.einsum(kv_eq, h, p["wk"]), cos, sin, cfg), seq="key_seq")
            v = md.rename(md.einsum(kv_eq, h, p["wv"]), seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_in"]) + p["b_in"])
            w_out = p["w_out"]
            if cfg.weight_norm:
                w_out = w_out * md.rsqrt(md.reduce_sum(w_out * w_out, "d_ff")) * p["g_out"]
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, w_out) + p["b_out"]
            return x + a + m

        x = md.repeat(block, md.gather(wte, ids, "vocab"), blocks, "layer")
        x = md.layer_norm(x, "d_model", lnf, lnf_b)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, lm_head) + lm_b
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"wte": wte, **blocks, "lnf": lnf, "lnf_b": lnf_b, "lm_head": lm_head, "lm_b": lm_b}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
