"""A Mamba-2-style language model with the chunked state-space duality (SSD) scan, written from the
README and docs/ alone (a held-out model).

Each layer of the ``md.repeat`` stack (pre-RMSNorm, residual) projects the tokens to ``X`` and a gate
``Z`` (``[batch, seq, heads, hdim]``), to ``B`` and ``C`` (``[batch, seq, dstate]``, one group shared
by the heads) and to per-head steps ``dt = softplus(. + dt_bias)`` (softplus written ``log(1 + exp)``);
``X`` passes a causal depthwise conv over ``seq`` (``w [tap, heads, hdim]``) and SiLU. The scan
``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t . h_t + D x_t`` (``A = -exp(A_log)``, a
scalar per head) is computed chunkwise: ``seq`` is cut into ``chunk`` chunks of ``pos`` positions
by ``md.rearrange``, and

- within a chunk, the quadratic (attention-like) form: the log-decays' ``md.cumsum`` over ``pos``,
  a ``[pos, kpos]`` decay mask ``exp(cum[pos] - cum[kpos])`` for ``kpos <= pos`` (``md.where``
  before and after the ``md.exp``), contracted with ``C . B`` and ``dt x``;
- each chunk's final state ``[batch, chunk, heads, hdim, dstate]`` from its inputs decayed to
  the chunk's end;
- between chunks (``inter``): ``"scan"`` passes the state along by an ``md.repeat`` over
  ``chunk`` (carry ``H``, stacked per-chunk states and decays, the state entering each chunk a
  per-step output), ``"quadratic"`` sums the earlier chunks' states with the decays between them
  made by an exclusive ``md.cumsum`` over ``chunk`` and a strictly causal ``[chunk, kchunk]`` mask;
- the state entering the chunk, read by ``C`` decayed from the chunk's start, adds to the output.

The output is gated (``y * silu(Z)``), RMS-normalised per head over ``hdim`` and projected back.
A tied LM head and the next-token cross-entropy.

Legend: b batch, s seq, d d_model, h heads, p hdim, n dstate, c chunk (kchunk), l pos (kpos).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 32
    chunk_len: int = 8
    d_model: int = 32
    heads: int = 4
    hdim: int = 16
    dstate: int = 8
    conv: int = 4
    layers: int = 2
    batch: int = 4
    inter: str = "scan"          # or "quadratic"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, seq=8, chunk_len=2, d_model=8, heads=2, hdim=4, dstate=4, conv=3, layers=2, batch=4)


def _chunks(t: md.Tensor, q: int) -> md.Tensor:
    """``seq`` cut into ``chunk`` x ``pos``."""
    rest = " ".join(n for n in t.shape.names if n not in ("batch", "seq"))
    return md.rearrange(t, f"batch (chunk pos) {rest} -> batch chunk pos {rest}", pos=q)


def _decay_mask(cum: md.Tensor) -> md.Tensor:
    """[batch, chunk, pos, kpos, heads]: exp(cum[pos] - cum[kpos]) where kpos <= pos, else 0."""
    causal = md.causal_mask(cum.shape["pos"], md.Dim("kpos", cum.shape["pos"].size))
    diff = cum - md.rename(cum, pos="kpos")
    return md.where(causal, md.exp(md.where(causal, diff, 0.0)), 0.0)


def _states_between(states: md.Tensor, total: md.Tensor, inter: str) -> md.Tensor:
    """The state entering each chunk, [batch, chunk, heads, hdim, dstate], from each chunk's own
    final state ``states`` and its total log-decay ``total [batch, chunk, heads]``."""
    if inter == "scan":
        zero = md.broadcast_to(md.constant(0.0), [states.shape[n] for n in ("batch", "heads", "hdim", "dstate")])

        def step(h: md.Tensor, q: dict):
            return h * q["decay"] + q["state"], {"h_in": h}

        _, per = md.repeat(step, zero, {"state": states, "decay": md.exp(total)}, "chunk")
        return md.transpose(per["h_in"], ["batch", "chunk", "heads", "hdim", "dstate"])
    incl = md.cumsum(total, "chunk")
    excl = md.cumsum(total, "chunk", exclusive=True)
    kc = md.Dim("kchunk", total.shape["chunk"].size)
    before = md.less(md.arange(kc), md.arange(total.shape["chunk"]))       # kchunk < chunk, strictly
    gap = excl - md.rename(incl, chunk="kchunk")
    w = md.where(before, md.exp(md.where(before, gap, 0.0)), 0.0)          # [batch, chunk, kchunk, heads]
    return md.einsum("batch chunk kchunk heads, batch kchunk heads hdim dstate -> batch chunk heads hdim dstate",
                     w, md.rename(states, chunk="kchunk"))


def ssd(x: md.Tensor, dt: md.Tensor, a_log: md.Tensor, b: md.Tensor, c: md.Tensor, q: int, inter: str) -> md.Tensor:
    """y [batch, seq, heads, hdim] of the scan, chunk length ``q``."""
    xc, dtc, bc, cc = _chunks(x, q), _chunks(dt, q), _chunks(b, q), _chunks(c, q)
    la = dtc * (-md.exp(a_log))                                        # [batch, chunk, pos, heads]
    cum = md.cumsum(la, "pos")
    cb = md.einsum("batch chunk pos dstate, batch chunk kpos dstate -> batch chunk pos kpos",
                   cc, md.rename(bc, pos="kpos"))
    xw = md.rename(xc * dtc, pos="kpos")
    y_diag = md.einsum("batch chunk pos kpos heads, batch chunk kpos heads hdim -> batch chunk pos heads hdim",
                       _decay_mask(cum) * cb, xw)
    last = md.squeeze(md.slice_(cum, "pos", q - 1, q), "pos")          # [batch, chunk, heads]
    to_end = md.exp(last - cum) * dtc
    states = md.einsum("batch chunk pos dstate, batch chunk pos heads hdim -> batch chunk heads hdim dstate",
                       bc, xc * to_end)
    h_in = _states_between(states, last, inter)
    y_off = md.einsum("batch chunk pos heads dstate, batch chunk heads hdim dstate -> batch chunk pos heads hdim",
                      cc * md.exp(cum), h_in)
    y = md.rearrange(y_diag + y_off, "batch chunk pos heads hdim -> batch (chunk pos) heads hdim")
    return md.rename(y, chunk_pos="seq")


def build(cfg: Config = Config()) -> md.Model:
    if cfg.inter not in ("scan", "quadratic"):
        raise ValueError(f"inter={cfg.inter!r}: 'scan' or 'quadratic'")
    if cfg.seq % cfg.chunk_len:
        raise ValueError(f"seq {cfg.seq} is not a multiple of chunk_len {cfg.chunk_len}")
    bd, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, p, n = md.Dim("heads", cfg.heads), md.Dim("hdim", cfg.hdim), md.Dim("dstate", cfg.dstate)
    L, v = md.Dim("layer", cfg.layers), md.Dim("vocab", cfg.vocab)
    with md.Graph("heldout_ssd") as graph:
        tokens = md.input("tokens", [bd, s], dtype=torch.int64)
        targets = md.input("targets", [bd, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        st = {
            "norm": md.param("norm", [L, d], init="ones"),
            "w_x": md.param("w_x", [L, d, h, p], fan_out=["layer", "heads", "hdim"]),
            "w_z": md.param("w_z", [L, d, h, p], fan_out=["layer", "heads", "hdim"]),
            "w_b": md.param("w_b", [L, d, n], fan_out=["layer", "dstate"]),
            "w_c": md.param("w_c", [L, d, n], fan_out=["layer", "dstate"]),
            "w_dt": md.param("w_dt", [L, d, h], fan_out=["layer", "heads"]),
            "dt_bias": md.param("dt_bias", [L, h], init=-1.0),
            "a_log": md.param("a_log", [L, h], init="uniform", scale=1.0),
            "d_skip": md.param("d_skip", [L, h], init="ones"),
            "w_conv": md.param("w_conv", [L, md.Dim("tap", cfg.conv), h, p], fan_out=["layer", "heads", "hdim"]),
            "gnorm": md.param("gnorm", [L, h, p], init="ones"),
            "w_out": md.param("w_out", [L, h, p, d], fan_out=["layer", "d_model"]),
        }
        ln_f = md.param("ln_f", [d], init="ones")

        def block(x: md.Tensor, q: dict) -> md.Tensor:
            u = md.rms_norm(x, "d_model", q["norm"])
            proj = "batch seq d_model, d_model heads hdim -> batch seq heads hdim"
            xs = md.silu(md.conv(md.einsum(proj, u, q["w_x"]), q["w_conv"], {"seq": "tap"}, padding="causal"))
            z = md.einsum(proj, u, q["w_z"])
            bm = md.einsum("batch seq d_model, d_model dstate -> batch seq dstate", u, q["w_b"])
            cm = md.einsum("batch seq d_model, d_model dstate -> batch seq dstate", u, q["w_c"])
            dt = md.log(1.0 + md.exp(md.einsum("batch seq d_model, d_model heads -> batch seq heads", u, q["w_dt"])
                                     + q["dt_bias"]))
            y = ssd(xs, dt, q["a_log"], bm, cm, cfg.chunk_len, cfg.inter) + xs * q["d_skip"]
            # eps 1e-3, not 1e-6: at init some heads' rows of y are near 0, and a norm over 4 values
            # then magnifies fp32 rounding: with 1e-6, the same model with dstate permuted (the same
            # math, summed in another order) moved the dense gradients by 1.5e-4 of the largest
            y = md.rms_norm(y * md.silu(z), "hdim", q["gnorm"], eps=1e-3)
            return x + md.einsum("batch seq heads hdim, heads hdim d_model -> batch seq d_model", y, q["w_out"])

        x = md.repeat(block, md.gather(wte, tokens, "vocab"), st, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(x, "d_model", ln_f), wte)
        loss = md.reduce_mean(md.cross_entropy(logits, targets, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"tokens": t[:, :-1], "targets": t[:, 1:]}

    return md.Model(graph, loss, {"wte": wte, **st, "ln_f": ln_f}, feeds, cfg, logits=logits)
