"""Held-out model (round 18b): YOCO (you only cache once), written from the docs alone.

A self-decoder stack (``self_layer``: sliding-window causal attention and a SwiGLU MLP, pre-norm)
runs first; its normed output makes ONE global key/value pair; a cross-decoder stack
(``cross_layer``) then cross-attends, causally, in every layer to that same k and v (only the
queries and the MLP are per layer). Next-token cross-entropy. Two stacks, each pipelinable.
form=window: md.attention(..., window=); form=mask: the same window as a composite iota mask.

Legend: b batch, s seq, ks key_seq, h heads, e d_head, d d_model, f d_ff, V vocab.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "window"        # window | mask
    vocab: int = 64
    batch: int = 4
    seq: int = 32
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    self_layers: int = 2
    cross_layers: int = 2
    window: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=12, d_model=8, heads=2, d_head=4, d_ff=16, self_layers=2,
                   cross_layers=2, window=3)


def _mlp(x, p):
    b = md.rms_norm(x, "d_model", p["ln2"])
    gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_gate"])
    up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_up"])
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])


def _layer_params(prefix, L, D, H, E, F):
    fo = [L.name]
    return {
        "ln1": md.param(f"{prefix}ln1", [L, D], init="ones"), "ln2": md.param(f"{prefix}ln2", [L, D], init="ones"),
        "wq": md.param(f"{prefix}wq", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [L, H, E, D], fan_out=fo + ["d_model"]),
        "w_gate": md.param(f"{prefix}w_gate", [L, D, F], fan_out=fo + ["d_ff"]),
        "w_up": md.param(f"{prefix}w_up", [L, D, F], fan_out=fo + ["d_ff"]),
        "w_down": md.param(f"{prefix}w_down", [L, F, D], fan_out=fo + ["d_model"]),
    }


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("window", "mask"):
        raise ValueError(f"form={cfg.form!r}: 'window' or 'mask'")
    B, S, KS = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    D, V, F = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff)
    H, E = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    LS, LC = md.Dim("self_layer", cfg.self_layers), md.Dim("cross_layer", cfg.cross_layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf, ln_kv = md.param("lnf", [D], init="ones"), md.param("ln_kv", [D], init="ones")
        wk_g = md.param("wk_g", [D, H, E], fan_out=["heads", "d_head"])
        wv_g = md.param("wv_g", [D, H, E], fan_out=["heads", "d_head"])
        self_p = _layer_params("self_", LS, D, H, E, F)
        self_p["wk"] = md.param("self_wk", [LS, D, H, E], fan_out=["self_layer", "heads", "d_head"])
        self_p["wv"] = md.param("self_wv", [LS, D, H, E], fan_out=["self_layer", "heads", "d_head"])
        cross_p = _layer_params("cross_", LC, D, H, E, F)
        dist = md.arange(S) - md.arange(KS)
        window_keep = md.logical_and(md.greater_equal(dist, 0), md.less(dist, cfg.window))

        def self_block(x, p):
            a = md.rms_norm(x, "d_model", p["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            q = md.einsum(proj, a, p["wq"])
            k, v = (md.rename(md.einsum(proj, a, p[w]), seq="key_seq") for w in ("wk", "wv"))
            if cfg.form == "window":
                y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, window=cfg.window)
            else:
                s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq",
                              q, k) * cfg.d_head ** -0.5
                att = md.softmax(md.where(window_keep, s, -1e9), "key_seq")
                y = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
            return _mlp(x, p)

        h = md.repeat(self_block, md.gather(wte, ids, "vocab"), self_p, LS, remat=cfg.remat)
        hn = md.rename(md.rms_norm(h, "d_model", ln_kv), seq="key_seq")      # the one cache
        k_g = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hn, wk_g)
        v_g = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hn, wv_g)

        def cross_block(x, p):
            a = md.rms_norm(x, "d_model", p["ln1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["wq"])
            y = md.attention(q, k_g, v_g, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
            return _mlp(x, p)

        out = md.rms_norm(md.repeat(cross_block, h, cross_p, LC, remat=cfg.remat), "d_model", lnf)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", out, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, logits=logits)
