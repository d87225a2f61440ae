"""A RetNet-style decoder (multi-scale retention), written from the README and docs/ alone (a held-out model).

Retention replaces the softmax: ``o = ((q k^T) * D) v`` with a causal decay mask
``D[h, n, m] = gamma_h ** (n - m)`` for ``n >= m`` and 0 otherwise, ``gamma_h = 1 - 2**(-5 - h)``
per head. The mask is built from positions: ``md.exp((arange(seq) - arange(key_seq)) *
log(gamma))`` under ``md.where(md.causal_mask(...))``. q and k are rotated by xPos-free
rotary angles (cos/sin tables of the position). Each head's output is group-normalised
(a mean and variance over ``d_head``, written from ops), gated by ``swish(x W_g)`` and
projected. ``recurrent=True`` computes the same decay by a ``md.cumsum`` over the sequence of
``log(gamma)`` instead (the chunkwise form's log-decays). A SwiGLU MLP; RMSNorm; a tied LM head
and a cross-entropy over the next token.

Legend: b = batch, s = seq, k = key_seq, h = heads, e = d_head.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 64
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    layers: int = 2
    batch: int = 4
    recurrent: bool = False   # the decay from a cumsum of log-gammas over seq

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, seq=8, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, batch=4)


def decay_mask(seq: md.Dim, key_seq: md.Dim, heads: md.Dim, recurrent: bool) -> md.Tensor:
    """[heads, seq, key_seq]: gamma_h ** (n - m) where n >= m, else 0."""
    log_gamma = md.constant(torch.log(1 - 2.0 ** (-5.0 - torch.arange(heads.size, dtype=torch.float32))), [heads])
    if recurrent:   # the log-decay accumulated along the sequence: L[n] = (n + 1) * log(gamma)
        acc = md.cumsum(md.broadcast_to(log_gamma, [heads, seq]), "seq")
        diff = acc - md.rename(acc, seq=key_seq.name)
    else:
        diff = md.cast(md.arange(seq) - md.arange(key_seq), torch.float32) * log_gamma
    causal = md.causal_mask(seq, key_seq)
    return md.where(causal, md.exp(md.where(causal, diff, 0.0)), 0.0)


def rotate(x: md.Tensor, pos: str, d_head: int, theta: float = 10000.0) -> md.Tensor:
    """Rotary angles over the two halves of d_head."""
    half = d_head // 2
    n = x.shape[pos].size
    ang = torch.arange(n, dtype=torch.float32)[:, None] * theta ** (-torch.arange(half, dtype=torch.float32) / half)
    cos, sin = md.constant(ang.cos(), [pos, "rot"]), md.constant(ang.sin(), [pos, "rot"])
    x = md.rearrange(x, f"batch {pos} heads (two rot) -> batch {pos} heads two rot", two=2)
    x1, x2 = md.squeeze(md.slice_(x, "two", 0, 1), "two"), md.squeeze(md.slice_(x, "two", 1, 2), "two")
    y = md.concat([md.unsqueeze(x1 * cos - x2 * sin, "two"), md.unsqueeze(x2 * cos + x1 * sin, "two")], "two")
    return md.rename(md.rearrange(y, f"batch {pos} heads two rot -> batch {pos} heads (two rot)"), two_rot="d_head")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_retnet") as g:
        tokens = md.input("tokens", [batch, seq], dtype=torch.int64)
        targets = md.input("targets", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        fan = ["layer", heads, d_head]
        stack = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=fan),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=fan),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=fan),
            "wg": md.param("wg", [layer, d_model, heads, d_head], fan_out=fan),
            "gn": md.param("gn", [layer, heads, d_head], init="ones"),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        ln_f = md.param("ln_f", [d_model], init="ones")
        mask = decay_mask(seq, key_seq, heads, cfg.recurrent)          # made once, read by every layer

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            x = md.rms_norm(h, "d_model", p["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            q = rotate(md.einsum(proj, x, p["wq"]), "seq", cfg.d_head)
            k = rotate(md.einsum(proj, x, p["wk"]), "seq", cfg.d_head)
            v = md.einsum(proj, x, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            s = s * mask * cfg.d_head ** -0.5
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", s, v)
            # group norm: one group per head, over d_head
            mu = md.reduce_mean(o, "d_head")
            var = md.reduce_mean((o - mu) ** 2, "d_head")
            o = (o - mu) * md.rsqrt(var + 1e-5) * p["gn"]
            o = o * md.silu(md.einsum(proj, x, p["wg"]))
            h = h + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            x = md.rms_norm(h, "d_model", p["ln2"])
            a = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["w_gate"]))
            b = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["w_up"])
            return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", a * b, p["w_down"])

        h = md.repeat(block, md.gather(wte, tokens, "vocab"), stack, "layer")
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(h, "d_model", ln_f), wte)
        loss = md.reduce_mean(md.cross_entropy(logits, targets, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"tokens": t[:, :-1], "targets": t[:, 1:]}

    return md.Model(g, loss, {"wte": wte, **stack, "ln_f": ln_f}, feeds, cfg)
