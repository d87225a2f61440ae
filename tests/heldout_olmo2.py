"""Held-out model (round 18b): an OLMo-2-style decoder, written from the docs alone.

Reordered norms: each sub-layer's output is RMS-normed before the residual add (OLMo 2's
"norm after"), parametric (a learned scale) or not (``norm_scale=False``); QK-norm (rms_norm over
``d_head`` of q and k, per head); RoPE; a SwiGLU MLP; blocks under md.repeat; the next-token
cross-entropy plus a z-loss (``z_loss * logsumexp(logits)**2``). Projections use md.einsum with
``...``. form=causal: md.attention causal; form=sinks: md.attention(..., window=, sinks=).

Legend: b batch, s seq, ks key_seq, h heads, e d_head, d d_model, f d_ff, V vocab.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "causal"        # causal | sinks
    norm_scale: bool = True     # the reordered norms' learned scale (OLMo 2) or none
    vocab: int = 64
    batch: int = 4
    seq: int = 32
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    window: int = 4
    sinks: int = 2
    z_loss: float = 1e-2        # large for a tiny model, so its gradient is visible in a check
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=12, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, window=3, sinks=2)


def _rope(x, cos, sin, half):
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, 2 * half)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("causal", "sinks"):
        raise ValueError(f"form={cfg.form!r}: 'causal' or 'sinks'")
    B, S = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    D, V, F, L = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    H, E = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    half, fo = cfg.d_head // 2, ["layer"]
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf = md.param("lnf", [D], init="ones")
        stacked = {
            "wq": md.param("wq", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=fo + ["d_model"]),
            "q_norm": md.param("q_norm", [L, E], init="ones"), "k_norm": md.param("k_norm", [L, E], init="ones"),
            "w_gate": md.param("w_gate", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_up": md.param("w_up", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_down": md.param("w_down", [L, F, D], fan_out=fo + ["d_model"]),
        }
        if cfg.norm_scale:
            stacked["post_attn"] = md.param("post_attn", [L, D], init="ones")
            stacked["post_mlp"] = md.param("post_mlp", [L, D], init="ones")
        inv_freq = md.constant(10000.0 ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
        ang = md.cast(md.arange(S), torch.float32) * inv_freq
        cos, sin = md.cos(ang), md.sin(ang)
        cos_k, sin_k = md.rename(cos, seq="key_seq"), md.rename(sin, seq="key_seq")

        def block(x, p):
            q = md.rms_norm(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", x, p["wq"]), "d_head", p["q_norm"])
            k = md.rms_norm(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", x, p["wk"]), "d_head", p["k_norm"])
            v = md.einsum("... d_model, d_model heads d_head -> ... heads d_head", x, p["wv"])
            q = _rope(q, cos, sin, half)
            k = _rope(md.rename(k, seq="key_seq"), cos_k, sin_k, half)
            v = md.rename(v, seq="key_seq")
            if cfg.form == "sinks":
                y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, window=cfg.window, sinks=cfg.sinks)
            else:
                y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            a = md.einsum("... heads d_head, heads d_head d_model -> ... d_model", y, p["wo"])
            x = x + md.rms_norm(a, "d_model", p.get("post_attn"))
            gate = md.einsum("... d_model, d_model d_ff -> ... d_ff", x, p["w_gate"])
            up = md.einsum("... d_model, d_model d_ff -> ... d_ff", x, p["w_up"])
            m = md.einsum("... d_ff, d_ff d_model -> ... d_model", md.silu(gate) * up, p["w_down"])
            return x + md.rms_norm(m, "d_model", p.get("post_mlp"))

        h = md.rms_norm(md.repeat(block, md.gather(wte, ids, "vocab"), stacked, L, remat=cfg.remat), "d_model", lnf)
        logits = md.einsum("... d_model, d_model vocab -> ... vocab", h, lm_head)
        ce = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        z = md.reduce_mean(md.square(md.logsumexp(logits, "vocab")))
        loss = ce + cfg.z_loss * z

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, logits=logits)
