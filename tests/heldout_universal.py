"""A Universal Transformer decoder, written from README.md and docs/ alone (a held-out model).

Legend: b batch, s seq (``key_seq``), d d_model, h heads, e d_head, f d_ff, v vocab, l step
(the recurrence's steps, the ``md.repeat`` dim).

ONE transformer layer (post-LN: attention then a transition MLP) is applied ``steps`` times:
``md.repeat(block, x, {"step_emb": ...}, step)`` whose only stacked tensor is the per-step
embedding added to the state before each application (Dehghani et al.'s coordinate
embedding: sinusoidal position plus a per-step signal). The layer's weights are params read
from outside the block, shared by every step (their gradient is the steps' sum). ``step_emb``:
``param`` (a learned ``[step, d_model]``), ``constant`` (the sinusoidal timing signal, a stacked
``md.constant``) or ``both`` (their sum).

``mix``: ``last`` (the state after the last step) or ``soft`` (each step's state and a halting
logit are per-step outputs; the output is their mix by a softmax over ``step`` of the logits,
a differentiable stand-in for ACT's halting; a function of every step at once, so it does not
pipeline). Each step also returns its mean halting logit, and ``ponder_weight`` times their
sum joins the loss (a ponder cost read linearly). An untied head, next-token CE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 32
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    steps: int = 4
    step_emb: str = "both"
    mix: str = "last"
    ponder_weight: float = 0.01
    remat: str = "none"       # what each layer saves for its backward (md.repeat remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, steps=4)


def timing_signal(n: int, d: int) -> torch.Tensor:
    """[n, d]: sin on the first half, cos on the second, geometric frequencies (Vaswani et al.)."""
    half = d // 2
    inv = torch.exp(-math.log(1e4) * torch.arange(half, dtype=torch.float32) / max(half - 1, 1))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)


def layer(x: md.Tensor, p: dict, w: dict, cfg: Config):
    x = x + p["step_emb"]
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, w["wq"])
    kv_in = md.rename(x, seq="key_seq")
    k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv_in, w["wk"])
    v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv_in, w["wv"])
    o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    x = md.layer_norm(x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"]),
                      "d_model", w["ln1"])
    u = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, w["w1"]))
    x = md.layer_norm(x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, w["w2"]), "d_model", w["ln2"])
    halt = md.einsum("batch seq d_model, d_model -> batch seq", x, w["w_halt"])
    out = {"ponder": md.reduce_mean(halt)}
    if cfg.mix == "soft":
        out.update(state=x, halt=halt)
    return x, out


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("step", cfg.steps)
    with md.Graph("heldout_universal") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        shared = {
            "wq": md.param("wq", [d, h, e], fan_out=[h, e]), "wk": md.param("wk", [d, h, e], fan_out=[h, e]),
            "wv": md.param("wv", [d, h, e], fan_out=[h, e]), "wo": md.param("wo", [h, e, d], fan_out=[d]),
            "ln1": md.param("ln1", [d], init="ones"), "ln2": md.param("ln2", [d], init="ones"),
            "w1": md.param("w1", [d, f], fan_out=[f]), "w2": md.param("w2", [f, d], fan_out=[d]),
            "w_halt": md.param("w_halt", [d], scale=0.1),
        }
        pos = md.constant(timing_signal(cfg.seq, cfg.d_model), [s, d], name="position_signal")
        learned = md.param("step_emb", [l, d], scale=0.1)
        fixed = md.constant(timing_signal(cfg.steps, cfg.d_model), [l, d], name="step_signal")
        step = {"param": learned, "constant": fixed, "both": None}[cfg.step_emb]
        stacked = {"step_emb": learned + fixed if step is None else step}
        x0 = md.gather(wte, ids, "vocab") + pos
        x, per_step = md.repeat(lambda t, p: layer(t, p, shared, cfg), x0, stacked, l, remat=cfg.remat)
        if cfg.mix == "soft":
            weights = md.softmax(per_step["halt"], "step")                               # [step, b, s]
            x = md.einsum("step batch seq, step batch seq d_model -> batch seq d_model", weights, per_step["state"])
        head = md.param("head", [v, d], fan_out=[v])
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) \
            + cfg.ponder_weight * md.reduce_sum(per_step["ponder"], "step")

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    params = {"wte": wte, **shared, "head": head}
    if cfg.step_emb != "constant":
        params["step_emb"] = learned
    return md.Model(g, loss, params, feeds, cfg, logits=logits, outputs={"ponder": per_step["ponder"]})
