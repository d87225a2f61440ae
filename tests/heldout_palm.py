"""A PaLM / GPT-J-style decoder, written from the README and docs/ alone (a held-out model).

A parallel block (attention and MLP both read the same pre-norm of the carry, and both are
added to it), multi-query attention (``heads`` query heads share one key and one value head:
k and v carry no head dim at all, and the fused ``md.attention`` broadcasts them), rotary
embeddings on the first ``rotary`` features of ``d_head`` only, in GPT-J's interleaved form
(features ``2i`` and ``2i+1`` turn together: ``md.rearrange`` cuts ``d_head`` into
``(pair two)``), a SwiGLU MLP, RMSNorm, no biases anywhere, and the input embedding tied to
the output head. A causal LM loss.
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
    rotary: int = 4          # features of d_head that turn (even, at most d_head)
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    rope_theta: float = 10000.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=8, rotary=4, d_ff=32, layers=2, seq=8, batch=4)


def rotate_pairs(x: md.Tensor, seq: str, cfg: Config) -> md.Tensor:
    """GPT-J rotary on the first ``cfg.rotary`` features of ``d_head``; positions along ``seq``."""
    half = cfg.rotary // 2
    pair = md.Dim("pair", half)
    inv_freq = md.constant(cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half), [pair])
    angles = md.cast(md.arange(x.shape.get(seq)), torch.float32) * inv_freq        # [seq, pair]
    cos, sin = md.cos(angles), md.sin(angles)
    turned = md.slice_(x, "d_head", 0, cfg.rotary)
    kept = md.slice_(x, "d_head", cfg.rotary, cfg.d_head)
    names = " ".join(d.name for d in turned.shape)
    cut = names.replace("d_head", "(pair two)")
    turned = md.rearrange(turned, f"{cut} -> {cut.replace('(pair two)', 'pair two')}", two=2)
    even = md.squeeze(md.slice_(turned, "two", 0, 1), "two")
    odd = md.squeeze(md.slice_(turned, "two", 1, 2), "two")
    out_even = md.unsqueeze(even * cos - odd * sin, md.Dim("two", 1))
    out_odd = md.unsqueeze(odd * cos + even * sin, md.Dim("two", 1))
    both = md.concat([out_even, out_odd], "two")                                    # [..., pair, two]
    order = " ".join(d.name for d in both.shape)
    merged = md.rearrange(both, f"{order} -> {order.replace('pair two', '(pair two)')}")
    return md.concat([md.rename(merged, pair_two="d_head"), kept], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_palm") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=1.0)
        blocks = {
            "norm": md.param("norm", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, d_head], fan_out=["layer", d_head]),        # one key head
            "wv": md.param("wv", [layer, d_model, d_head], fan_out=["layer", d_head]),        # one value head
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["norm"])                 # one norm, read by both branches
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model d_head -> batch seq d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model d_head -> batch seq d_head", h, p["wv"])
            q = rotate_pairs(q, "seq", cfg)
            k = rotate_pairs(md.rename(k, seq="key_seq"), "key_seq", cfg)
            o = md.attention(q, k, md.rename(v, seq="key_seq"), "seq", "key_seq", "d_head", causal=True)
            attn = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            mlp = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])
            return x + attn + mlp

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte)   # tied head
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, {"wte": wte, **blocks, "norm_f": norm_f}, feeds, cfg, logits=logits)
