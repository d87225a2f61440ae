"""Held-out model (round 20b): a Gated Linear Attention language model, chunked form.

Written from the user docs alone. Each block is pre-norm GLA + a SwiGLU MLP, stacked under
``md.repeat`` over ``layer``. GLA keeps a state ``S [d_key, d_val]`` per head that decays by a
data-dependent gate ``a_t`` (one per key feature) and gains ``k_t v_t^T`` at each step:
``S_t = diag(a_t) S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t``. The chunked form cuts ``seq`` into
``chunks`` of ``clen`` steps:

- inside a chunk, a causal attention whose scores decay as ``exp(b_i - b_j)``, where ``b`` is the
  cumulative log-gate over the chunk (``md.cumsum`` over ``clen``);
- across chunks, each chunk's contribution ``U_c = sum_j k_j exp(g_c - b_j) v_j^T`` (``g_c`` the
  chunk's total log-gate) reaches a later chunk ``c'`` decayed by the cumulative product of the
  gates between them: ``exp(E_c' - I_c)`` with ``E``, ``I`` the exclusive and inclusive
  ``md.cumsum`` of ``g`` over ``chunks``. No recurrence: a split ``seq`` (its outer part
  ``chunks``) stays split.

Legend: b batch, c chunks, c2 src_chunks, i clen (query step), j key_step, h heads, k d_key,
v d_val, d d_model, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 2
    d_key: int = 8
    d_val: int = 8
    d_ff: int = 64
    layers: int = 4
    seq: int = 16
    clen: int = 4
    batch: int = 8
    gate_tau: float = 4.0     # GLA's temperature: log a = log_sigmoid(.) / tau keeps a near 1
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_key=4, d_val=4, d_ff=16, layers=4, seq=8,
                   clen=2, batch=4)


def _intra(q, k, v, b, cfg, clen, key_step):
    """Causal attention inside each chunk, scores decayed by exp(b_i - b_j) per key feature."""
    keep = md.greater_equal(md.arange(clen), md.arange(key_step))          # [clen, key_step]
    kj, bj = md.rename(k, clen="key_step"), md.rename(b, clen="key_step")
    vj = md.rename(v, clen="key_step")
    # exp only where j <= i (b_i - b_j <= 0 there): no overflow on the masked half
    decay = md.exp(md.where(keep, b - bj, 0.0))
    scores = md.einsum("batch chunks clen heads d_key, batch chunks key_step heads d_key, "
                       "batch chunks clen key_step heads d_key -> batch chunks heads clen key_step",
                       q, kj, decay)
    scores = md.where(keep, scores, 0.0)
    return md.einsum("batch chunks heads clen key_step, batch chunks key_step heads d_val "
                     "-> batch chunks clen heads d_val", scores, vj)


def _inter(q, k, v, b, cfg):
    """Each earlier chunk's state contribution, decayed by the gates' cumulative product."""
    g = md.slice_(b, "clen", cfg.clen - 1, cfg.clen)                       # total log-gate per chunk
    g = md.squeeze(g, "clen")                                             # [batch, chunks, heads, d_key]
    u = md.einsum("batch chunks clen heads d_key, batch chunks clen heads d_val "
                  "-> batch chunks heads d_key d_val", k * md.exp(g - b), v)
    excl = md.cumsum(g, "chunks", exclusive=True)                          # E_c: gates before chunk c
    incl = md.rename(excl + g, chunks="src_chunks")                        # I_c2: through chunk c2 (one scan)
    chunks, src = q.shape["chunks"], md.Dim("src_chunks", q.shape["chunks"].size)
    earlier = md.less(md.arange(src), md.arange(chunks))                   # [src_chunks, chunks]
    carry = md.exp(md.where(earlier, excl - incl, 0.0))
    carry = md.where(earlier, carry, 0.0)
    state = md.einsum("batch chunks src_chunks heads d_key, batch src_chunks heads d_key d_val "
                      "-> batch chunks heads d_key d_val", carry, md.rename(u, chunks="src_chunks"))
    return md.einsum("batch chunks clen heads d_key, batch chunks heads d_key d_val "
                     "-> batch chunks clen heads d_val", q * md.exp(b), state)


def _gla(x, p, cfg, clen, key_step):
    xc = md.rearrange(x, "batch (chunks clen) d_model -> batch chunks clen d_model", clen=cfg.clen)
    proj = lambda w: md.einsum("... d_model, d_model heads e -> ... heads e",  # noqa: E731
                               xc, md.rename(w, {w.shape.names[-1]: "e"}))
    q = md.rename(proj(p["wq"]), e="d_key") * cfg.d_key ** -0.5
    k = md.rename(proj(p["wk"]), e="d_key")
    v = md.rename(proj(p["wv"]), e="d_val")
    log_a = md.log_sigmoid(md.rename(proj(p["wa"]), e="d_key") + p["ba"]) / cfg.gate_tau
    b = md.cumsum(log_a, "clen")
    o = _intra(q, k, v, b, cfg, clen, key_step) + _inter(q, k, v, b, cfg)
    o = md.rms_norm(o, "d_val", p["gn"])                                   # per-head norm
    o = o * md.silu(md.rename(proj(p["wg"]), e="d_val"))                   # output gate
    o = md.rename(md.rearrange(o, "batch chunks clen heads d_val -> batch (chunks clen) heads d_val"),
                  chunks_clen="seq")
    return md.einsum("batch seq heads d_val, heads d_val d_model -> batch seq d_model", o, p["wo"])


def build(cfg: Config = Config()) -> md.Model:
    V, D = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, K, E = md.Dim("heads", cfg.heads), md.Dim("d_key", cfg.d_key), md.Dim("d_val", cfg.d_val)
    F, L = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    B, S = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    clen, key_step = md.Dim("clen", cfg.clen), md.Dim("key_step", cfg.clen)
    with md.Graph("gla") as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=0.5)
        stacked = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, K], fan_out=["layer", "heads", "d_key"]),
            "wk": md.param("wk", [L, D, H, K], fan_out=["layer", "heads", "d_key"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_val"]),
            "wa": md.param("wa", [L, D, H, K], fan_out=["layer", "heads", "d_key"]),
            "ba": md.param("ba", [L, H, K], scale=0.5),
            "wg": md.param("wg", [L, D, H, E], fan_out=["layer", "heads", "d_val"]),
            "gn": md.param("gn", [L, H, E], init="ones"),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "w_gate": md.param("w_gate", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_up": md.param("w_up", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [L, F, D], fan_out=["layer", "d_model"]),
        }

        def block(x, p):
            x = x + _gla(md.rms_norm(x, "d_model", p["ln1"]), p, cfg, clen, key_step)
            h = md.rms_norm(x, "d_model", p["ln2"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model",
                                 md.silu(gate) * up, p["w_down"])

        x = md.gather(wte, ids, "vocab")
        x = md.repeat(block, x, stacked, "layer", remat=None if cfg.remat == "none" else cfg.remat)
        x = md.rms_norm(x, "d_model", md.param("lnf", [D], init="ones"))
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x,
                           md.param("lm_head", [V, D], fan_out=["vocab"]))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), feeds, cfg, logits=logits)


def recurrent_reference(cfg: Config, params: dict, ids: torch.Tensor) -> torch.Tensor:
    """GLA's step-by-step recurrence in plain torch (the chunked form must equal it): the loss."""
    p = {k: v.double() for k, v in params.items()}
    x = p["wte"][ids]

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    for layer in range(cfg.layers):
        lp = {k: v[layer] for k, v in p.items() if v.dim() and k not in ("wte", "lnf", "lm_head")}
        h = rms(x, lp["ln1"])
        q = torch.einsum("bsd,dhk->bshk", h, lp["wq"]) * cfg.d_key ** -0.5
        k = torch.einsum("bsd,dhk->bshk", h, lp["wk"])
        v = torch.einsum("bsd,dhe->bshe", h, lp["wv"])
        a = torch.exp(torch.nn.functional.logsigmoid(torch.einsum("bsd,dhk->bshk", h, lp["wa"])
                                                     + lp["ba"]) / cfg.gate_tau)
        state = torch.zeros(x.shape[0], cfg.heads, cfg.d_key, cfg.d_val, dtype=x.dtype)
        outs = []
        for t in range(cfg.seq):
            state = a[:, t, :, :, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append(torch.einsum("bhk,bhke->bhe", q[:, t], state))
        o = rms(torch.stack(outs, 1), lp["gn"])
        o = o * torch.nn.functional.silu(torch.einsum("bsd,dhe->bshe", h, lp["wg"]))
        x = x + torch.einsum("bshe,hed->bsd", o, lp["wo"])
        h = rms(x, lp["ln2"])
        mlp = torch.nn.functional.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])
        x = x + mlp @ lp["w_down"]
    logits = rms(x, p["lnf"]) @ p["lm_head"].T
    return logits
