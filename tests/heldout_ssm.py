"""A Mamba-style selective state-space language model, written from the README and docs/ alone
(a held-out model).

Each layer of the ``md.repeat`` stack (pre-RMSNorm, residual) projects the tokens to an inner
stream ``u`` and a gate ``z``; ``u`` goes through a causal depthwise conv over ``seq``
(``md.conv`` with ``w [tap, d_inner]`` and ``padding="causal"``) and SiLU. The selective scan
``h_t = a_t h_{t-1} + dt_t B_t u_t``, ``y_t = C_t . h_t + D u_t`` has input-dependent steps
``dt = softplus(u . w_dt + b)`` (softplus written ``log(1 + exp(x))``), per-channel decays
``log a_t = -dt_t exp(A_log)`` over a ``state`` dim, and ``B_t``, ``C_t`` made from ``u``. The
docs offer no recurrence op, so it is written in its stable quadratic form: ``L = cumsum(log
a)`` over ``seq`` (``md.cumsum``), ``h_t = sum_{s <= t} exp(L_t - L_s) dt_s B_s u_s`` with the
differences masked causally (``md.where`` with ``md.causal_mask``, then ``md.exp``), contracted
with ``C_t`` by einsums. The output ``y * silu(z)`` is projected back; the head is untied and
the loss the next-token cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    d_inner: int = 64
    state: int = 8
    taps: int = 4
    layers: int = 2
    seq: int = 32
    batch: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=8, d_inner=12, state=4, taps=3, layers=2, seq=8, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    vocab, d_model, d_inner = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("d_inner", cfg.d_inner)
    state, tap, layer = md.Dim("state", cfg.state), md.Dim("tap", cfg.taps), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_ssm") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.5)
        blocks = {
            "norm": md.param("norm", [layer, d_model], init="ones"),
            "w_u": md.param("w_u", [layer, d_model, d_inner], fan_out=["layer", d_inner]),
            "w_z": md.param("w_z", [layer, d_model, d_inner], fan_out=["layer", d_inner]),
            "conv": md.param("conv", [layer, tap, d_inner], fan_out=["layer", d_inner]),
            "w_dt": md.param("w_dt", [layer, d_inner], fan_out=["layer"], scale=0.1),
            "b_dt": md.param("b_dt", [layer, d_inner], init="zeros"),
            "a_log": md.param("a_log", [layer, d_inner, state], fan_out=["layer", d_inner, state], scale=0.5),
            "w_b": md.param("w_b", [layer, d_inner, state], fan_out=["layer", state]),
            "w_c": md.param("w_c", [layer, d_inner, state], fan_out=["layer", state]),
            "d_skip": md.param("d_skip", [layer, d_inner], init="ones"),
            "w_out": md.param("w_out", [layer, d_inner, d_model], fan_out=["layer", d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        head = md.param("head", [d_model, vocab], fan_out=[vocab])
        causal = md.causal_mask(seq, key_seq)

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.rms_norm(x, "d_model", p["norm"])
            u = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", h, p["w_u"])
            z = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", h, p["w_z"])
            u = md.silu(md.conv(u, p["conv"], {"seq": "tap"}, padding="causal"))
            dt = md.log(1.0 + md.exp(u * p["w_dt"] + p["b_dt"]))                 # [batch, seq, d_inner]
            log_a = -dt * md.exp(p["a_log"])                                      # [batch, seq, d_inner, state]
            big_l = md.cumsum(log_a, "seq")
            b = md.einsum("batch seq d_inner, d_inner state -> batch seq state", u, p["w_b"])
            c = md.einsum("batch seq d_inner, d_inner state -> batch seq state", u, p["w_c"])
            drive = md.rename(dt * u * b, seq="key_seq")                         # [batch, key_seq, d_inner, state]
            gap = big_l - md.rename(big_l, seq="key_seq")                         # L_t - L_s
            decay = md.exp(md.where(causal, gap, -1e9))
            hs = md.einsum("batch seq d_inner state key_seq, batch key_seq d_inner state -> batch seq d_inner state",
                           decay, drive)
            y = md.einsum("batch seq d_inner state, batch seq state -> batch seq d_inner", hs, c) + u * p["d_skip"]
            y = y * md.silu(z)
            return x + md.einsum("batch seq d_inner, d_inner d_model -> batch seq d_model", y, p["w_out"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, blocks, "layer")
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    return md.Model(g, loss, {"wte": wte, **blocks, "norm_f": norm_f, "head": head}, feeds, cfg, logits=logits)
