"""A Jamba-style hybrid decoder, written from the README and docs/ alone (a held-out model).

Each layer of the one stack has two halves: causal attention (fused ``md.attention``) with a
SwiGLU MLP, then a selective state-space mixer (Mamba-like) with a routed mixture-of-experts MLP;
so attention and SSM alternate, and MoE is every other sub-layer. The SSM half: an input
projection to ``d_inner``, a short causal depthwise conv over ``seq``, a step size
``dt = softplus(x W_dt + b_dt)``, input- and output-dependent ``B``, ``C`` of ``d_state``, and the
diagonal recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`` written in log space: the running
log decay ``cumsum(dt A)`` over ``seq``, and each output ``y_t = sum_{s<=t} C_t exp(L_t - L_s) dt_s
B_s x_s`` as one einsum over ``seq`` x ``key_seq`` under a causal mask (exact for a tiny ``seq``).
``ssm="scan"`` runs the recurrence step by step instead, an inner ``md.repeat`` over ``seq``.
The MoE picks the top-1 expert per token by ``md.top_k`` and computes every expert densely,
weighted by the one-hot of the choice and its gate; a Switch balance loss per layer (taken per
sequence, averaged over the batch last) is a per-layer output summed into the loss.

Legend: batch, seq (key_seq: the same positions as keys), d_model, heads, d_head, d_ff,
d_inner, d_state, experts, e_ff, tap (conv), layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    d_inner: int = 48
    d_state: int = 8
    experts: int = 4
    e_ff: int = 32
    taps: int = 3
    layers: int = 2
    seq: int = 16
    batch: int = 4
    balance: float = 0.01
    ssm: str = "logspace"      # or "scan"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=12, heads=2, d_head=6, d_ff=24, d_inner=12, d_state=4, experts=3, e_ff=12,
                   layers=2, seq=12, batch=4)


def ssm_logspace(u_bsi, dt_bsi, a_in, b_bsn, c_bsn, seq, key_seq):
    """The diagonal recurrence as one masked einsum: log decays by a cumsum over seq."""
    log_decay = md.cumsum(md.einsum("batch seq d_inner, d_inner d_state -> batch seq d_inner d_state", dt_bsi, a_in), "seq")
    later = md.rename(log_decay, seq="key_seq")
    gap = log_decay - later                                            # [batch, seq, d_inner, d_state, key_seq]
    keep = md.greater_equal(md.arange(seq) - md.arange(key_seq), 0)
    w = md.exp(md.where(keep, gap, -1e9))
    drive = md.rename(md.einsum("batch seq d_inner, batch seq d_state -> batch seq d_inner d_state", dt_bsi * u_bsi, b_bsn),
                      seq="key_seq")
    return md.einsum("batch seq d_inner d_state key_seq, batch key_seq d_inner d_state, batch seq d_state -> batch seq d_inner",
                     w, drive, c_bsn)


def ssm_scan(u_bsi, dt_bsi, a_in, b_bsn, c_bsn, batch, d_inner, d_state):
    """The same recurrence one step per position: an inner repeat over seq, the state as its carry."""
    decay = md.exp(md.einsum("batch seq d_inner, d_inner d_state -> seq batch d_inner d_state", dt_bsi, a_in))
    drive = md.einsum("batch seq d_inner, batch seq d_state -> seq batch d_inner d_state", dt_bsi * u_bsi, b_bsn)
    readout = md.einsum("batch seq d_state -> seq batch d_state", c_bsn)

    def step(h, p):
        h = h * p["decay"] + p["drive"]
        return h, {"y": md.einsum("batch d_inner d_state, batch d_state -> batch d_inner", h, p["c"])}

    h0 = md.constant(torch.zeros(batch.size, d_inner.size, d_state.size), [batch, d_inner, d_state])
    _, out = md.repeat(step, h0, {"decay": decay, "drive": drive, "c": readout}, "seq")
    return md.einsum("seq batch d_inner -> batch seq d_inner", out["y"])


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, d_inner, d_state = md.Dim("d_ff", cfg.d_ff), md.Dim("d_inner", cfg.d_inner), md.Dim("d_state", cfg.d_state)
    experts, e_ff, tap = md.Dim("experts", cfg.experts), md.Dim("e_ff", cfg.e_ff), md.Dim("tap", cfg.taps)
    vocab, layer = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    L = "layer"
    with md.Graph("heldout_jamba") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        blocks = {
            "n1": md.param("n1", [layer, d_model], init="ones"),
            "wqkv": md.param("wqkv", [layer, md.Dim("three", 3), d_model, heads, d_head], fan_out=[L, "three", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[L, d_model]),
            "n2": md.param("n2", [layer, d_model], init="ones"),
            "w_gate": md.param("w_gate", [layer, d_model, d_ff], fan_out=[L, d_ff]),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=[L, d_ff]),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=[L, d_model]),
            "n3": md.param("n3", [layer, d_model], init="ones"),
            "w_in": md.param("w_in", [layer, d_model, d_inner], fan_out=[L, d_inner]),
            "w_z": md.param("w_z", [layer, d_model, d_inner], fan_out=[L, d_inner]),
            "conv": md.param("conv", [layer, tap, d_inner], fan_out=[L, d_inner]),
            "w_dt": md.param("w_dt", [layer, d_inner, md.Dim("d_inner_out", cfg.d_inner)], fan_out=[L, "d_inner_out"]),
            "b_dt": md.param("b_dt", [layer, d_inner], init=-1.0),
            "a_log": md.param("a_log", [layer, d_inner, d_state], init="uniform", scale=1.0),
            "w_b": md.param("w_b", [layer, d_inner, d_state], fan_out=[L, d_state]),
            "w_c": md.param("w_c", [layer, d_inner, d_state], fan_out=[L, d_state]),
            "d_skip": md.param("d_skip", [layer, d_inner], init="ones"),
            "w_out": md.param("w_out", [layer, d_inner, d_model], fan_out=[L, d_model]),
            "n4": md.param("n4", [layer, d_model], init="ones"),
            "router": md.param("router", [layer, d_model, experts], fan_out=[L, experts]),
            "e_up": md.param("e_up", [layer, experts, d_model, e_ff], fan_out=[L, experts, e_ff]),
            "e_down": md.param("e_down", [layer, experts, e_ff, d_model], fan_out=[L, experts, d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        head = md.param("head", [d_model, vocab], fan_out=[vocab])

        def attention_half(x, p):
            h = md.rms_norm(x, "d_model", p["n1"])
            qkv = md.einsum("batch seq d_model, three d_model heads d_head -> three batch seq heads d_head", h, p["wqkv"])
            q, k, v = (md.squeeze(md.slice_(qkv, "three", i, i + 1), "three") for i in range(3))
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["n2"])
            u = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])) * \
                md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_down"])

        def ssm_half(x, p):
            h = md.rms_norm(x, "d_model", p["n3"])
            u = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", h, p["w_in"])
            z = md.einsum("batch seq d_model, d_model d_inner -> batch seq d_inner", h, p["w_z"])
            u = md.silu(md.conv(u, p["conv"], {"seq": "tap"}, padding="causal"))
            dt = md.softplus(md.rename(md.einsum("batch seq d_inner, d_inner d_inner_out -> batch seq d_inner_out",
                                                 u, p["w_dt"]), d_inner_out="d_inner") + p["b_dt"])
            a = -md.exp(p["a_log"])
            b_ = md.einsum("batch seq d_inner, d_inner d_state -> batch seq d_state", u, p["w_b"])
            c_ = md.einsum("batch seq d_inner, d_inner d_state -> batch seq d_state", u, p["w_c"])
            if cfg.ssm == "scan":
                y = ssm_scan(u, dt, a, b_, c_, batch, d_inner, d_state)
            else:
                y = ssm_logspace(u, dt, a, b_, c_, seq, key_seq)
            y = (y + u * p["d_skip"]) * md.silu(z)
            return x + md.einsum("batch seq d_inner, d_inner d_model -> batch seq d_model", y, p["w_out"])

        def moe_half(x, p):
            h = md.rms_norm(x, "d_model", p["n4"])
            probs = md.softmax(md.einsum("batch seq d_model, d_model experts -> batch seq experts", h, p["router"]), "experts")
            top, idx = md.top_k(probs, "experts", 1, new_dim="pick")
            choice = md.reduce_sum(md.one_hot(idx, experts), "pick")             # [batch, seq, experts]
            gate = choice * md.reduce_sum(top, "pick")
            hid = md.gelu(md.einsum("batch seq d_model, experts d_model e_ff -> batch seq experts e_ff", h, p["e_up"]))
            y = md.einsum("batch seq experts e_ff, experts e_ff d_model, batch seq experts -> batch seq d_model",
                          hid, p["e_down"], gate)
            # Switch balance: fraction routed x mean prob, per sequence, averaged over the batch last
            frac, mean_p = md.reduce_mean(choice, "seq"), md.reduce_mean(probs, "seq")
            aux = cfg.experts * md.reduce_mean(md.reduce_sum(frac * mean_p, "experts"), "batch")
            return x + y, aux

        def block(x, p):
            x, aux = moe_half(ssm_half(attention_half(x, p), p), p)
            return x, {"balance": aux}

        x, per_layer = md.repeat(block, md.gather(wte, ids, "vocab"), blocks, "layer", remat=cfg.remat)
        x = md.rms_norm(x, "d_model", norm_f)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, head)
        balance = md.reduce_sum(per_layer["balance"], "layer")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + cfg.balance * balance

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"wte": wte, **blocks, "norm_f": norm_f, "head": head}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
