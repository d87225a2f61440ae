"""A Gemma-2-style decoder written from the README and docs/ alone (a held-out model).

Local (sliding-window) and global attention layers alternate inside ONE ``md.repeat``: each
layer's window is a stacked ``[layer]`` tensor beside its weights (a constant, or with
``window_from="input"`` a fed int64 input ``windows``), a global layer's window being the whole
sequence, so the mask ``0 <= seq - key_seq < window`` is made per layer in the block. Grouped-
query attention (q ``[.., kv_heads, group, d_head]``), the attention logits soft-capped
(``tanh(s / c) * c``) in a composite attention, RMSNorm before and after the attention and
the MLP (the post-norm on the branch, before the residual add), a GeGLU MLP (gelu gate times
up), the embedding scaled by sqrt(d_model) and tied to the head, and the final logits
soft-capped.

Legend: b batch, s seq, t key_seq, d d_model, k kv_heads, g group, e d_head, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    kv_heads: int = 2
    group: int = 2
    d_head: int = 8
    d_ff: int = 64
    layers: int = 4
    seq: int = 16
    batch: int = 4
    window: int = 4              # the local layers' window (the even layers; odd layers are global)
    attn_cap: float = 50.0
    final_cap: float = 30.0
    window_from: str = "constant"   # or "input": fed as ``windows`` [layer], int64
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, kv_heads=2, group=2, d_head=4, d_ff=24, layers=4, seq=8, batch=4,
                   window=3, attn_cap=2.0, final_cap=3.0)


def softcap(x: md.Tensor, cap: float) -> md.Tensor:
    return md.tanh(x * (1.0 / cap)) * cap


def windows(cfg: Config) -> torch.Tensor:
    """Each layer's window: ``window`` on the even (local) layers, the whole sequence on the odd."""
    return torch.tensor([cfg.window if i % 2 == 0 else cfg.seq for i in range(cfg.layers)], dtype=torch.int64)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.window_from not in ("constant", "input"):
        raise ValueError(f"window_from must be 'constant' or 'input', not {cfg.window_from!r}")
    b, s, t = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d, k, g = md.Dim("d_model", cfg.d_model), md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group)
    e, f, v, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_gemma2") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = {n: md.param(n, [L, d], init="ones") for n in ("pre_attn", "post_attn", "pre_mlp", "post_mlp")}
        p["wq"] = md.param("wq", [L, d, k, g, e], fan_out=["layer", "kv_heads", "group", "d_head"])
        p["wk"] = md.param("wk", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"])
        p["wv"] = md.param("wv", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"])
        p["wo"] = md.param("wo", [L, k, g, e, d], fan_out=["layer", "d_model"])
        p["w_gate"] = md.param("w_gate", [L, d, f], fan_out=["layer", "d_ff"])
        p["w_up"] = md.param("w_up", [L, d, f], fan_out=["layer", "d_ff"])
        p["w_down"] = md.param("w_down", [L, f, d], fan_out=["layer", "d_model"])
        norm_f = md.param("norm_f", [d], init="ones")
        stacked = dict(p)
        if cfg.window_from == "input":
            stacked["window"] = md.input("windows", [L], dtype=torch.int64)
        else:
            stacked["window"] = md.constant(windows(cfg), [L])
        dist = md.arange(s) - md.arange(t)                      # [seq, key_seq]: how far back the key is

        def block(x, p):
            visible = md.logical_and(md.greater_equal(dist, 0), md.less(dist, p["window"]))
            h = md.rms_norm(x, "d_model", p["pre_attn"])
            q = md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                          h, p["wq"])
            kk = md.einsum("batch key_seq d_model, d_model kv_heads d_head -> batch key_seq kv_heads d_head",
                           md.rename(h, seq="key_seq"), p["wk"])
            vv = md.einsum("batch key_seq d_model, d_model kv_heads d_head -> batch key_seq kv_heads d_head",
                           md.rename(h, seq="key_seq"), p["wv"])
            scores = md.einsum("batch seq kv_heads group d_head, batch key_seq kv_heads d_head "
                               "-> batch kv_heads group seq key_seq", q, kk) * cfg.d_head ** -0.5
            att = md.softmax(md.where(visible, softcap(scores, cfg.attn_cap), -1e9), "key_seq")
            o = md.einsum("batch kv_heads group seq key_seq, batch key_seq kv_heads d_head "
                          "-> batch seq kv_heads group d_head", att, vv)
            o = md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model",
                          o, p["wo"])
            x = x + md.rms_norm(o, "d_model", p["post_attn"])
            h = md.rms_norm(x, "d_model", p["pre_mlp"])
            gate = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"]))
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            y = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", gate * up, p["w_down"])
            return x + md.rms_norm(y, "d_model", p["post_mlp"])

        x = md.gather(wte, ids, "vocab") * cfg.d_model ** 0.5
        x = md.repeat(block, x, stacked, "layer", remat=cfg.remat)
        logits = softcap(md.einsum("batch seq d_model, vocab d_model -> batch seq vocab",
                                   md.rms_norm(x, "d_model", norm_f), wte), cfg.final_cap)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        out = {"ids": toks[:, :-1], "labels": toks[:, 1:]}
        if cfg.window_from == "input":
            out["windows"] = windows(cfg)
        return out

    return md.Model(graph, loss, {"wte": wte, **p, "norm_f": norm_f}, feeds, cfg, logits=logits)
