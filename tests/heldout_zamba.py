"""Held-out model (round 18b): Zamba-lite, written from the docs alone.

A stack of Mamba-like layers (pre-norm, a gated linear recurrence over seq per channel,
``h_t = a_t * h_{t-1} + (1 - a_t) * u_t`` with ``a_t = sigmoid(.)`` from the input, output gated
by silu(z)) in groups of ``every``; before each group ONE shared attention + MLP block (the same
params every time) reads the current hidden state concatenated with the original embedding
(``d_cat = 2 * d_model``) and adds its projection back. LM loss. The outer stack (``group``)
pipelines; the Mamba layers of a group are an inner repeat over ``sub``.
form=decay: the recurrence as a masked decay einsum; form=cumsum: ``cumsum`` of the input weighted
by ``exp(-cumsum(log a))`` (fine at tiny sizes, overflow-prone at long ones).

Legend: b batch, s seq, ks key_seq, h heads, e d_head, n d_inner, d d_model, c d_cat, f d_ff.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "decay"         # decay | cumsum
    vocab: int = 64
    batch: int = 4
    seq: int = 32
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_inner: int = 32
    d_ff: int = 64
    groups: int = 2             # applications of the shared block
    every: int = 2              # Mamba layers after each
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=12, d_model=8, heads=2, d_head=4, d_inner=8, d_ff=16, groups=2, every=2)


def _recurrence(form, u, log_a):
    """y_t = sum_{s <= t} prod_{s < r <= t} a_r (1 - a_s) u_s over seq, per (batch, d_inner)."""
    c = md.cumsum(log_a, "seq")
    x = u * (1.0 - md.exp(log_a))
    if form == "cumsum":
        return md.exp(c) * md.cumsum(x * md.exp(-c), "seq")
    c_k = md.rename(c, seq="key_seq")
    dist = md.arange(c.shape["seq"]) - md.arange(c_k.shape["key_seq"])
    decay = md.exp(md.where(md.greater_equal(dist, 0), c - c_k, -1e9))
    return md.einsum("batch seq key_seq d_inner, batch key_seq d_inner -> batch seq d_inner",
                     decay, md.rename(x, seq="key_seq"))


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("decay", "cumsum"):
        raise ValueError(f"form={cfg.form!r}: 'decay' or 'cumsum'")
    B, S = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    D, V, F, N = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff), md.Dim("d_inner", cfg.d_inner)
    H, E, C = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_cat", 2 * cfg.d_model)
    G, U = md.Dim("group", cfg.groups), md.Dim("sub", cfg.every)
    fo = ["group", "sub"]
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf = md.param("lnf", [D], init="ones")
        shared = {   # the one shared attention + MLP block, read by every group
            "ln_s1": md.param("ln_s1", [C], init="ones"), "ln_s2": md.param("ln_s2", [C], init="ones"),
            "wq": md.param("wq", [C, H, E], fan_out=["heads", "d_head"]),
            "wk": md.param("wk", [C, H, E], fan_out=["heads", "d_head"]),
            "wv": md.param("wv", [C, H, E], fan_out=["heads", "d_head"]),
            "wo": md.param("wo", [H, E, C], fan_out=["d_cat"]),
            "w_fc": md.param("w_fc", [C, F], fan_out=["d_ff"]),
            "w_proj": md.param("w_proj", [F, C], fan_out=["d_cat"]),
            "w_back": md.param("w_back", [C, D], fan_out=["d_model"]),
        }
        mamba = {
            "ln": md.param("ln", [G, U, D], init="ones"),
            "w_u": md.param("w_u", [G, U, D, N], fan_out=fo + ["d_inner"]),
            "w_z": md.param("w_z", [G, U, D, N], fan_out=fo + ["d_inner"]),
            "w_a": md.param("w_a", [G, U, D, N], fan_out=fo + ["d_inner"]),
            "a_bias": md.param("a_bias", [G, U, N], init="ones"),
            "w_out": md.param("w_out", [G, U, N, D], fan_out=fo + ["d_model"]),
        }
        emb = md.gather(wte, ids, "vocab")
        sp = shared

        def shared_block(x):
            c = md.rename(md.concat([x, emb], "d_model"), d_model="d_cat")
            a = md.rms_norm(c, "d_cat", sp["ln_s1"])
            proj = "batch seq d_cat, d_cat heads d_head -> batch seq heads d_head"
            q = md.einsum(proj, a, sp["wq"])
            k, v = (md.rename(md.einsum(proj, a, sp[w]), seq="key_seq") for w in ("wk", "wv"))
            y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            c = c + md.einsum("batch seq heads d_head, heads d_head d_cat -> batch seq d_cat", y, sp["wo"])
            m = md.gelu(md.einsum("batch seq d_cat, d_cat d_ff -> batch seq d_ff", md.rms_norm(c, "d_cat", sp["ln_s2"]), sp["w_fc"]))
            c = c + md.einsum("batch seq d_ff, d_ff d_cat -> batch seq d_cat", m, sp["w_proj"])
            return x + md.einsum("batch seq d_cat, d_cat d_model -> batch seq d_model", c, sp["w_back"])

        def mamba_layer(x, p):
            a = md.rms_norm(x, "d_model", p["ln"])
            u = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", a, p["w_u"])
            z = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", a, p["w_z"])
            log_a = md.log_sigmoid(md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", a, p["w_a"])
                                   + p["a_bias"])
            y = _recurrence(cfg.form, u, log_a) * md.silu(z)
            return x + md.einsum("batch seq d_inner, d_inner d_model -> batch seq d_model", y, p["w_out"])

        def group(x, p):
            return md.repeat(mamba_layer, shared_block(x), p, "sub")

        h = md.rms_norm(md.repeat(group, emb, mamba, G, remat=cfg.remat), "d_model", lnf)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, logits=logits)
