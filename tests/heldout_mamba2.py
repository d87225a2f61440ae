"""Held-out model (round 21a): Mamba2-lite, the SSD layer in its chunked form.

Written from the user docs alone. Each head has a scalar decay per step, ``a_t = exp(dt_t A)``
(``A = -exp(A_log) < 0``, ``dt = softplus(.)``), and a state ``S [d_state, d_head]`` with
``S_t = a_t S_{t-1} + dt_t B_t x_t^T`` and ``y_t = C_t S_t + D x_t`` (B, C shared by the heads).
The chunked form cuts ``seq`` into ``chunks`` of ``clen`` steps, the log-decays summed by
``md.cumsum``:

- intra-chunk: ``y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j`` (quadratic in clen);
- inter-chunk: each chunk's end state ``sum_j exp(cum_last - cum_j) dt_j B_j x_j^T`` reaches a
  later chunk ``c`` decayed by ``exp(E_c - I_c')`` (``E``, ``I`` the exclusive and inclusive
  cumsum of the chunks' total log-decays), then ``y_i += exp(cum_i) C_i . S_c``;
- the output gated by ``silu(z)``, RMS-normed over ``(heads, d_head)`` (d_inner), projected back.

Blocks (pre-RMSNorm, residual) under ``md.repeat`` over ``layer``. Legend: b batch, c chunks,
c2 src_chunks, i clen, j key_step, h heads, e d_head, n d_state, d d_model, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 16
    d_state: int = 16
    layers: int = 4
    seq: int = 32
    clen: int = 8
    batch: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_state=4, layers=4, seq=8, clen=2, batch=4)


def _chunk(t, clen: int):
    return md.rearrange(t, "batch (chunks clen) ... -> batch chunks clen ...", clen=clen)


def _ssd(x, dt, la, b, c):
    """y of the chunked SSD: x [b c i h e], dt and la (log-decay) [b c i h], b and c [b c i n]."""
    clen = x.shape["clen"]
    key = md.Dim("key_step", clen.size)
    cum = md.cumsum(la, "clen")                                          # [b c i h]
    keep = md.greater_equal(md.arange(clen), md.arange(key))
    cum_j = md.rename(cum, clen="key_step")
    decay = md.exp(md.where(keep, cum - cum_j, -1e4))                    # 0 above the diagonal
    cb = md.einsum("batch chunks clen d_state, batch chunks key_step d_state -> batch chunks clen key_step",
                   c, md.rename(b, clen="key_step"))
    xdt = x * dt
    y = md.einsum("batch chunks clen key_step, batch chunks clen key_step heads, "
                  "batch chunks key_step heads d_head -> batch chunks clen heads d_head",
                  cb, decay, md.rename(xdt, clen="key_step"))
    # each chunk's end state, and its decay to every later chunk
    last = md.reduce_sum(la, "clen")                                     # [b c h]
    states = md.einsum("batch chunks clen heads, batch chunks clen d_state, batch chunks clen heads d_head "
                       "-> batch chunks heads d_state d_head", md.exp(last - cum), b, xdt)
    src = md.Dim("src_chunks", x.shape["chunks"].size)
    excl = md.cumsum(last, "chunks", exclusive=True)                     # E_c
    incl = md.rename(md.cumsum(last, "chunks"), chunks="src_chunks")     # I_c'
    before = md.less(md.arange(src), md.arange(x.shape["chunks"]))       # c' < c
    carry = md.exp(md.where(before, excl - incl, -1e4))                  # [b c c2 h]
    s_in = md.einsum("batch chunks src_chunks heads, batch src_chunks heads d_state d_head "
                     "-> batch chunks heads d_state d_head", carry, md.rename(states, chunks="src_chunks"))
    return y + md.einsum("batch chunks clen heads, batch chunks clen d_state, batch chunks heads d_state d_head "
                         "-> batch chunks clen heads d_head", md.exp(cum), c, s_in)


def _mixer(h, p, cfg: Config):
    def proj(w, out):
        return md.einsum(f"batch seq d_model, d_model {out} -> batch seq {out}", h, p[w])
    x, z = proj("w_x", "heads d_head"), proj("w_z", "heads d_head")
    b, c = proj("w_b", "d_state"), proj("w_c", "d_state")
    dt = md.softplus(proj("w_dt", "heads") + p["dt_bias"])
    la = dt * -md.exp(p["a_log"])                                        # log-decay per step, < 0
    ch = [_chunk(t, cfg.clen) for t in (x, dt, la, b, c)]
    y = md.rearrange(_ssd(*ch), "batch chunks clen heads d_head -> batch (chunks clen) heads d_head")
    y = md.rename(y, chunks_clen="seq") + x * p["d_skip"]
    y = y * md.silu(z)
    # md.rms_norm takes one dim: over d_inner = (heads, d_head) it is written out
    y = y * md.rsqrt(md.reduce_mean(y * y, ["heads", "d_head"]) + 1e-6) * p["norm"]
    return md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["w_out"])


def build(cfg: Config = Config()) -> md.Model:
    V, D = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E, N = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_state", cfg.d_state)
    L, B, S = md.Dim("layer", cfg.layers), md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    with md.Graph("mamba2") as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=0.5)
        stacked = {
            "ln": md.param("ln", [L, D], init="ones"),
            "w_x": md.param("w_x", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "w_z": md.param("w_z", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "w_b": md.param("w_b", [L, D, N], fan_out=["layer", "d_state"]),
            "w_c": md.param("w_c", [L, D, N], fan_out=["layer", "d_state"]),
            "w_dt": md.param("w_dt", [L, D, H], fan_out=["layer", "heads"]),
            "dt_bias": md.param("dt_bias", [L, H], init=-1.0),
            "a_log": md.param("a_log", [L, H], scale=0.5),
            "d_skip": md.param("d_skip", [L, H], init="ones"),
            "norm": md.param("norm", [L, H, E], init="ones"),
            "w_out": md.param("w_out", [L, H, E, D], fan_out=["layer", "d_model"]),
        }

        def block(x, p):
            return x + _mixer(md.rms_norm(x, "d_model", p["ln"]), p, cfg)

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


REF_INPUTS = ("ids", "labels")


def reference_loss(cfg: Config, params: dict, ids, labels):
    """Mamba2's recurrence step by step in plain torch (float64): the chunked form must equal it."""
    p = {k: v.double() for k, v in params.items()}
    F = torch.nn.functional

    def rms(t, w, dims):
        return t * torch.rsqrt(t.pow(2).mean(dims, keepdim=True) + 1e-6) * w

    x = p["wte"][ids]
    for layer in range(cfg.layers):
        lp = {k: v[layer] for k, v in p.items() if k not in ("wte", "lnf", "lm_head")}
        h = rms(x, lp["ln"], (-1,))
        xs, z = (torch.einsum("bsd,dhe->bshe", h, lp[w]) for w in ("w_x", "w_z"))
        bs, cs = h @ lp["w_b"], h @ lp["w_c"]
        dt = F.softplus(h @ lp["w_dt"] + lp["dt_bias"])
        a = torch.exp(dt * -torch.exp(lp["a_log"]))
        state = torch.zeros(x.shape[0], cfg.heads, cfg.d_state, cfg.d_head, dtype=x.dtype)
        ys = []
        for t in range(cfg.seq):
            state = a[:, t, :, None, None] * state + \
                dt[:, t, :, None, None] * bs[:, t, None, :, None] * xs[:, t, :, None, :]
            ys.append(torch.einsum("bn,bhne->bhe", cs[:, t], state))
        y = torch.stack(ys, 1) + xs * lp["d_skip"][:, None]
        y = rms(y * F.silu(z), lp["norm"], (-2, -1))
        x = x + torch.einsum("bshe,hed->bsd", y, lp["w_out"])
    logits = rms(x, p["lnf"], (-1,)) @ p["lm_head"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
