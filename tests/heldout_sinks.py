"""Held-out model (round 16b): StreamingLLM-style attention with sinks, written from the docs alone.

A Llama-like decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention) whose attention is causal
over a sliding window of ``window`` keys plus the first ``sinks`` tokens, always visible.
form=mask: the mask is built from iota comparisons (dist = arange(seq) - arange(key_seq)) in the
composite attention; form=fused: md.attention(..., window=, sinks=), the same mask fused (under
``seq:model`` a halo of window - 1 key/value rows plus the first ``sinks`` rows, not k and v
gathered); form=window: md.attention's fused window (sinks must be 0: the same model without
sinks, a cross-check of the mask form).

Legend: b batch, s seq, ks key_seq, kv kv_heads, g group, e d_head, d d_model, f d_ff, V vocab.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "mask"         # mask | fused | window (see the module docstring)
    vocab: int = 64
    batch: int = 4
    seq: int = 32
    d_model: int = 32
    kv_heads: int = 2
    group: int = 2
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    window: int = 4
    sinks: int = 2

    remat: str = "none"        # md.repeat's remat: none | full | selective

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=12, d_model=8, kv_heads=2, group=2, d_head=4, d_ff=16,
                   layers=2, window=3, sinks=2)


def _rope(x, cos, sin, half):
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, 2 * half)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def _attend(cfg, q, k, v, S, KS):
    if cfg.form in ("window", "fused"):
        return md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, window=cfg.window, sinks=cfg.sinks)
    dist = md.arange(S) - md.arange(KS)                                   # [seq, key_seq]
    keep = md.logical_and(md.greater_equal(dist, 0),
                          md.logical_or(md.less(dist, cfg.window), md.less(md.arange(KS), cfg.sinks)))
    scores = md.einsum("batch seq kv_heads group d_head, batch key_seq kv_heads d_head "
                       "-> batch kv_heads group seq key_seq", q, k) * cfg.d_head ** -0.5
    att = md.softmax(md.where(keep, scores, -1e9), "key_seq")
    return md.einsum("batch kv_heads group seq key_seq, batch key_seq kv_heads d_head "
                     "-> batch seq kv_heads group d_head", att, v)


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("mask", "fused", "window") or (cfg.form == "window" and cfg.sinks):
        raise ValueError(f"form={cfg.form!r}, sinks={cfg.sinks}: 'mask', 'fused', or 'window' with sinks=0")
    B, S, KS = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    D, V, F, L = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    KV, G, E = md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group), md.Dim("d_head", cfg.d_head)
    half = cfg.d_head // 2
    fo = ["layer"]
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf = md.param("lnf", [D], init="ones")
        stacked = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, KV, G, E], fan_out=fo + ["kv_heads", "group", "d_head"]),
            "wk": md.param("wk", [L, D, KV, E], fan_out=fo + ["kv_heads", "d_head"]),
            "wv": md.param("wv", [L, D, KV, E], fan_out=fo + ["kv_heads", "d_head"]),
            "wo": md.param("wo", [L, KV, G, E, D], fan_out=fo + ["d_model"]),
            "w_gate": md.param("w_gate", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_up": md.param("w_up", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_down": md.param("w_down", [L, F, D], fan_out=fo + ["d_model"]),
        }
        inv_freq = md.constant(10000.0 ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
        ang = md.cast(md.arange(S), torch.float32) * inv_freq                   # [seq, d_head/2]
        cos, sin = md.cos(ang), md.sin(ang)
        cos_k, sin_k = md.rename(cos, seq="key_seq"), md.rename(sin, seq="key_seq")

        def block(x, p):
            a = md.rms_norm(x, "d_model", p["ln1"])
            q = _rope(md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                                a, p["wq"]), cos, sin, half)
            k = _rope(md.rename(md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head",
                                          a, p["wk"]), seq="key_seq"), cos_k, sin_k, half)
            v = md.rename(md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head",
                                    a, p["wv"]), seq="key_seq")
            y = _attend(cfg, q, k, v, S, KS)
            x = x + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model",
                              y, p["wo"])
            b = md.rms_norm(x, "d_model", p["ln2"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        h = md.rms_norm(md.repeat(block, md.gather(wte, ids, "vocab"), stacked, L, remat=cfg.remat), "d_model", lnf)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, "lm_head": lm_head, "lnf": lnf, **stacked}, make_feeds, cfg, logits=logits)
