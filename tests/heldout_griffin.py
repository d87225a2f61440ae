"""A Griffin (Hawk + local attention) decoder, written from the README and docs/ alone (a held-out model).

A repeat over ``blk`` of one block: a recurrent layer and a local-attention layer, each a
pre-RMSNorm residual sub-layer followed by a gated-GELU MLP. The recurrent layer: two branches
from the normed input, ``gelu(x W_gate)`` and ``x W_in``; the second goes through a short causal
depthwise conv over ``seq`` (``md.conv``, ``taps`` taps) and the RG-LRU, then the branches multiply
and ``W_out`` projects back. RG-LRU: ``r_t = sigmoid(x_t W_a)``, ``i_t = sigmoid(x_t W_x)``,
``log a_t = -c r_t softplus(-Lambda)`` (``a_t = sigmoid(Lambda)^(c r_t)``, c = 8),
``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)``. No recurrence op exists, so ``scan`` picks:

- ``"cumsum"``: ``P_t = cumsum(log a)``; ``h_t = exp(P_t) * cumsum(b_t exp(-P_t))`` (log-space
  cumulative products, ``md.cumsum``: a split ``seq`` costs one allgather of per-rank totals);
- ``"matrix"``: ``h_t = sum_{s<=t} exp(P_t - P_s) b_s``, a ``[seq, key_seq]`` decay matrix masked
  before the exp (stable; an einsum over ``key_seq``);
- ``"repeat"``: an inner ``md.repeat`` over ``seq``, the per-step ``a_t`` and ``b_t`` as its stacked
  tensor (side by side along ``ab``), the state as the carry (needs ``seq`` whole).

The attention layer is multi-query (one key/value head) with ``md.attention(window=w)``.

Legend: b batch, s seq, d d_model, r d_rnn, T tap, h heads, e d_head, f d_ff, V vocab, B blk.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    d_rnn: int = 96
    heads: int = 4
    d_head: int = 16
    d_ff: int = 192
    blocks: int = 2
    taps: int = 4
    window: int = 16
    seq: int = 64
    batch: int = 8
    scan: str = "cumsum"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, d_rnn=12, heads=2, d_head=4, d_ff=16, blocks=2, taps=3, window=3,
                   seq=12, batch=2)


C = 8.0
LAM0 = 4.0     # Lambda = LAM0 + a param around 0: a = sigmoid(Lambda)^c near 0.86..0.99, as Griffin's init


def rg_lru(x, p, scan: str):
    """``x [batch, seq, d_rnn]`` through the RG-LRU; the state starts at zero."""
    rx = "batch seq d_rnn, d_rnn d_rnn2 -> batch seq d_rnn2"
    r = md.rename(md.sigmoid(md.einsum(rx, x, p["w_a"])), d_rnn2="d_rnn")
    i = md.rename(md.sigmoid(md.einsum(rx, x, p["w_x"])), d_rnn2="d_rnn")
    log_a = -C * r * md.softplus(-(p["lam"] + LAM0))
    b = md.sqrt(1.0 - md.exp(2.0 * log_a)) * (i * x)
    if scan == "repeat":
        return _scan_repeat(log_a, b)
    pre = md.cumsum(log_a, "seq")
    if scan == "cumsum":
        return md.exp(pre) * md.cumsum(b * md.exp(-pre), "seq")
    pre_k = md.rename(pre, seq="key_seq")
    keep = md.causal_mask(pre.shape["seq"], pre_k.shape["key_seq"])
    decay = md.exp(md.where(keep, pre - pre_k, -1e9))                      # [batch, seq, d_rnn, key_seq]
    return md.einsum("batch seq d_rnn key_seq, batch key_seq d_rnn -> batch seq d_rnn", decay,
                     md.rename(b, seq="key_seq"))


def _scan_repeat(log_a, b):
    ab = md.concat([md.unsqueeze(md.exp(log_a), md.Dim("ab", 1)), md.unsqueeze(b, md.Dim("ab", 1))], "ab")
    h0 = md.reduce_sum(b * 0.0, "seq")                                      # zeros [batch, d_rnn]

    def step(h, q):
        a_t = md.squeeze(md.slice_(q["ab"], "ab", 0, 1), "ab")
        b_t = md.squeeze(md.slice_(q["ab"], "ab", 1, 2), "ab")
        h = a_t * h + b_t
        return h, {"h": h}

    _, per_step = md.repeat(step, h0, {"ab": ab}, "seq")
    return md.transpose(per_step["h"], ["batch", "seq", "d_rnn"])


def recurrent(x, p, cfg: Config):
    z = md.rms_norm(x, "d_model", p["ln_r"])
    gate = md.gelu(md.einsum("batch seq d_model, d_model d_rnn -> batch seq d_rnn", z, p["w_gate"]))
    u = md.einsum("batch seq d_model, d_model d_rnn -> batch seq d_rnn", z, p["w_in"])
    u = md.conv(u, p["conv"], {"seq": "tap"}, padding="causal") + p["conv_b"]
    y = rg_lru(u, p, cfg.scan) * gate
    return x + md.einsum("batch seq d_rnn, d_rnn d_model -> batch seq d_model", y, p["w_out"])


def local_attention(x, p, cfg: Config):
    z = md.rms_norm(x, "d_model", p["ln_a"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", z, p["wq"])
    kv = "batch seq d_model, d_model d_head -> batch seq d_head"
    k = md.rename(md.einsum(kv, z, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum(kv, z, p["wv"]), seq="key_seq")
    y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, window=cfg.window)
    return x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])


def mlp(x, p, tag: str):
    z = md.rms_norm(x, "d_model", p[f"ln_{tag}"])
    up = "batch seq d_model, d_model d_ff -> batch seq d_ff"
    u = md.gelu(md.einsum(up, z, p[f"{tag}_gate"])) * md.einsum(up, z, p[f"{tag}_up"])
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p[f"{tag}_down"])


def stacked_params(cfg: Config, B, d, r, r2, T, h, e, f) -> dict:
    p = {"ln_r": md.param("ln_r", [B, d], init="ones"), "ln_a": md.param("ln_a", [B, d], init="ones"),
         "w_gate": md.param("w_gate", [B, d, r], fan_out=[B, r]),
         "w_in": md.param("w_in", [B, d, r], fan_out=[B, r]),
         "conv": md.param("conv", [B, T, r], fan_out=[B, r]),
         "conv_b": md.param("conv_b", [B, r], init="zeros"),
         "w_a": md.param("w_a", [B, r, r2], fan_out=[B, r2]),
         "w_x": md.param("w_x", [B, r, r2], fan_out=[B, r2]),
         "lam": md.param("lam", [B, r], scale=1.0),
         "w_out": md.param("w_out", [B, r, d], fan_out=[B, d]),
         "wq": md.param("wq", [B, d, h, e], fan_out=[B, h, e]),
         "wk": md.param("wk", [B, d, e], fan_out=[B, e]),
         "wv": md.param("wv", [B, d, e], fan_out=[B, e]),
         "wo": md.param("wo", [B, h, e, d], fan_out=[B, d])}
    for tag in ("m1", "m2"):
        p[f"ln_{tag}"] = md.param(f"ln_{tag}", [B, d], init="ones")
        p[f"{tag}_gate"] = md.param(f"{tag}_gate", [B, d, f], fan_out=[B, f])
        p[f"{tag}_up"] = md.param(f"{tag}_up", [B, d, f], fan_out=[B, f])
        p[f"{tag}_down"] = md.param(f"{tag}_down", [B, f, d], fan_out=[B, d])
    return p


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    r, r2, T = md.Dim("d_rnn", cfg.d_rnn), md.Dim("d_rnn2", cfg.d_rnn), md.Dim("tap", cfg.taps)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    V, B = md.Dim("vocab", cfg.vocab), md.Dim("blk", cfg.blocks)
    with md.Graph("heldout_griffin") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        emb = md.param("emb", [V, d], scale=1.0)
        ln_f = md.param("ln_f", [d], init="ones")
        stacked = stacked_params(cfg, B, d, r, r2, T, h, e, f)

        def block(x, p):
            x = mlp(recurrent(x, p, cfg), p, "m1")
            return mlp(local_attention(x, p, cfg), p, "m2")

        x = md.gather(emb, ids, "vocab") * cfg.d_model ** 0.5
        x = md.repeat(block, x, stacked, B, remat=cfg.remat)
        x = md.rms_norm(x, "d_model", ln_f)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, emb)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}

    return md.Model(g, loss, {"emb": emb, "ln_f": ln_f, **stacked}, feeds, cfg, logits=logits)
