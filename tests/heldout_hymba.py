"""Held-out model (round 18b): Hymba-lite, written from the docs alone.

Learned meta tokens (``meta`` rows of params) are prepended to every sequence. Each layer runs, on
the same normed input, causal attention heads and SSM heads (a selective diagonal linear
recurrence over seq, ``h_t = a_t * h_{t-1} + (1 - a_t) * u_t`` per channel, ``a_t = sigmoid(.)``
made from the input, gated by silu(z)); each branch's output is RMS-normed and the two averaged,
then a SwiGLU MLP. LM loss on the real tokens' positions only.
form=decay: the recurrence as a masked decay einsum (``exp(cumsum(log a))`` ratios over
``seq x key_seq``); form=scan: a nested md.repeat over ``seq``.

Legend: b batch, t seq (meta + tokens), ks key_seq, h heads, e d_head, n d_ssm, d d_model, f d_ff.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "decay"         # decay | scan
    vocab: int = 64
    batch: int = 4
    seq: int = 28
    meta: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ssm: int = 32
    d_ff: int = 64
    layers: int = 2
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=10, meta=2, d_model=8, heads=2, d_head=4, d_ssm=8, d_ff=16, layers=2)


def _ssm_decay(u, log_a):
    """y_t = sum_{s <= t} prod_{s < r <= t} a_r (1 - a_s) u_s, as one masked einsum over key_seq."""
    c = md.cumsum(log_a, "seq")                                       # [batch, seq, d_ssm]
    c_k = md.rename(c, seq="key_seq")
    dist = md.arange(c.shape["seq"]) - md.arange(c_k.shape["key_seq"])
    decay = md.exp(md.where(md.greater_equal(dist, 0), c - c_k, -1e9))  # [batch, seq, key_seq, d_ssm]
    x_k = md.rename(u * (1.0 - md.exp(log_a)), seq="key_seq")
    return md.einsum("batch seq key_seq d_ssm, batch key_seq d_ssm -> batch seq d_ssm", decay, x_k)


def _ssm_scan(u, log_a):
    a = md.exp(log_a)
    steps = {"a": md.transpose(a, ["seq", "batch", "d_ssm"]), "u": md.transpose(u, ["seq", "batch", "d_ssm"])}

    def step(h, p):
        h = p["a"] * h + (1.0 - p["a"]) * p["u"]
        return h, {"y": h}

    h0 = md.constant(0.0, [u.shape["batch"], u.shape["d_ssm"]])
    _, ys = md.repeat(step, h0, steps, "seq")
    return md.transpose(ys["y"], ["batch", "seq", "d_ssm"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("decay", "scan"):
        raise ValueError(f"form={cfg.form!r}: 'decay' or 'scan'")
    T = cfg.meta + cfg.seq
    B, S, M = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("meta", cfg.meta)
    D, V, F, L = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    H, E, N = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ssm", cfg.d_ssm)
    fo = ["layer"]
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        meta = md.param("meta", [M, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf = md.param("lnf", [D], init="ones")
        stacked = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "ln_att": md.param("ln_att", [L, D], init="ones"), "ln_ssm": md.param("ln_ssm", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=fo + ["d_model"]),
            "w_u": md.param("w_u", [L, D, N], fan_out=fo + ["d_ssm"]),
            "w_z": md.param("w_z", [L, D, N], fan_out=fo + ["d_ssm"]),
            "w_a": md.param("w_a", [L, D, N], fan_out=fo + ["d_ssm"]),
            "a_bias": md.param("a_bias", [L, N], init="ones"),
            "w_so": md.param("w_so", [L, N, D], fan_out=fo + ["d_model"]),
            "w_gate": md.param("w_gate", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_up": md.param("w_up", [L, D, F], fan_out=fo + ["d_ff"]),
            "w_down": md.param("w_down", [L, F, D], fan_out=fo + ["d_model"]),
        }
        ssm = _ssm_decay if cfg.form == "decay" else _ssm_scan

        def block(x, p):
            a = md.rms_norm(x, "d_model", p["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            q = md.einsum(proj, a, p["wq"])
            k, v = (md.rename(md.einsum(proj, a, p[w]), seq="key_seq") for w in ("wk", "wv"))
            y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            att = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
            u = md.einsum("batch seq d_model, d_model d_ssm -> batch seq d_ssm", a, p["w_u"])
            z = md.einsum("batch seq d_model, d_model d_ssm -> batch seq d_ssm", a, p["w_z"])
            log_a = md.log_sigmoid(md.einsum("batch seq d_model, d_model d_ssm -> batch seq d_ssm", a, p["w_a"])
                                   + p["a_bias"])
            s = md.einsum("batch seq d_ssm, d_ssm d_model -> batch seq d_model", ssm(u, log_a) * md.silu(z), p["w_so"])
            x = x + 0.5 * (md.rms_norm(att, "d_model", p["ln_att"]) + md.rms_norm(s, "d_model", p["ln_ssm"]))
            b = md.rms_norm(x, "d_model", p["ln2"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", b, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        tok = md.gather(wte, ids, "vocab")                                      # [batch, seq, d_model]
        meta_b = md.rename(md.broadcast_to(meta, md.Shape([B, M, D])), meta="seq")
        x0 = md.concat([meta_b, tok], "seq")                                    # [batch, seq: meta + seq, d_model]
        assert x0.shape["seq"].size == T
        h = md.rms_norm(md.repeat(block, x0, stacked, L, remat=cfg.remat), "d_model", lnf)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.slice_(h, "seq", cfg.meta, T), lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, logits=logits)
