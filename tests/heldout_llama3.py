"""A Llama-3-style decoder written from the README and docs/ alone (a held-out model).

Grouped-query attention (``heads`` query heads in ``kv_heads`` groups), rotary embeddings
computed in the graph (or fed as inputs ``rope_cos``/``rope_sin``: ``rope_inputs``), a SwiGLU MLP, RMSNorm (pre-norm), no biases, the input embedding tied
to the output head, a causal mask, blocks under ``md.repeat``. The query heads are one dim
``heads`` in the weights, cut into ``kv_heads x group`` by ``md.rearrange`` for the attention,
so a layout may split ``heads`` or ``kv_heads``.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    kv_heads: int = 2
    d_head: int = 8
    d_ff: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 4
    rope_theta: float = 10000.0
    rope_inputs: bool = False   # the cos/sin tables fed as inputs ``rope_cos``/``rope_sin`` instead of computed

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, kv_heads=2, d_head=4, d_ff=24, layers=2, seq=8, batch=4)


def rotary_tables(seq: md.Dim, half: int, theta: float) -> tuple[md.Tensor, md.Tensor]:
    """cos and sin of the rotary angles, ``[seq, d_head]`` with ``d_head`` of size ``half``."""
    inv_freq = md.constant(theta ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
    angles = md.cast(md.arange(seq), torch.float32) * inv_freq
    return md.cos(angles), md.sin(angles)


def rotate(x: md.Tensor, cos: md.Tensor, sin: md.Tensor, d_head: int) -> md.Tensor:
    """Rotary embedding, the rotate-half form: pairs (i, i + d_head/2) turn by the angle of i."""
    half = d_head // 2
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, d_head)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    group = cfg.heads // cfg.kv_heads
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, kv_heads = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("kv_heads", cfg.kv_heads)
    d_head, d_ff, vocab, layer = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_llama3") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.02)
        blocks = {
            "attn_norm": md.param("attn_norm", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [layer, d_model, kv_heads, d_head], fan_out=[kv_heads, d_head]),
            "wv": md.param("wv", [layer, d_model, kv_heads, d_head], fan_out=[kv_heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[d_model]),
            "mlp_norm": md.param("mlp_norm", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=[d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=[d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=[d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")

        if cfg.rope_inputs:
            half = md.Dim("d_head", cfg.d_head // 2)
            cos_q, sin_q = md.input("rope_cos", [seq, half]), md.input("rope_sin", [seq, half])
        else:
            cos_q, sin_q = rotary_tables(seq, cfg.d_head // 2, cfg.rope_theta)
        cos_k, sin_k = md.rename(cos_q, seq="key_seq"), md.rename(sin_q, seq="key_seq")

        def block(x: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["attn_norm"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wv"])
            q = rotate(q, cos_q, sin_q, cfg.d_head)
            k = rotate(md.rename(k, seq="key_seq"), cos_k, sin_k, cfg.d_head)
            v = md.rename(v, seq="key_seq")
            q = md.rearrange(q, "batch seq (kv_heads group) d_head -> batch seq kv_heads group d_head", group=group)
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            o = md.rearrange(o, "batch seq kv_heads group d_head -> batch seq (kv_heads group) d_head")
            o = md.rename(o, kv_heads_group="heads")
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["mlp_norm"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte)   # tied head
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        out = {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        if cfg.rope_inputs:
            half = cfg.d_head // 2
            angles = torch.arange(cfg.seq, dtype=torch.float32)[:, None] * cfg.rope_theta ** (-torch.arange(half) / half)
            out.update(rope_cos=angles.cos(), rope_sin=angles.sin())
        return out

    return md.Model(g, loss, {"wte": wte, **blocks, "norm_f": norm_f}, feeds, cfg, logits=logits)
