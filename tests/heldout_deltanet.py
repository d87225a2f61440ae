"""Held-out model: DeltaNet, linear attention with the delta rule (h17a).

Per head the state S [d_k, d_v] is updated per token, S <- S - beta k (k^T S) + beta k v^T, and the
output is q^T S, with q and k L2-normalised. Two forms (Config.form):

- ``recurrent``: the rule token by token, an inner ``md.repeat`` over ``seq`` in each layer;
- ``chunk``: the chunkwise form. Within a chunk the pseudo-values U = T (beta V) and W = T (beta K),
  T = (I + tril(beta K K^T, -1))^-1 (a nilpotent Neumann series: exact), are made for every chunk
  at once by masked einsums; an inner ``md.repeat`` over ``chunks`` carries S:
  U' = U - W S, O = Q S + tril(Q K^T) U', S <- S + K^T U'.

Legend: b batch, s seq, c chunks, t chunk (position in a chunk), h heads, dk d_k, dv d_v.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 2
    d_k: int = 8
    d_v: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    chunk: int = 4
    form: str = "recurrent"
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=16, d_model=8, heads=2, d_k=4, d_v=4, d_ff=16, layers=2, seq=8, batch=2, chunk=4)


def _l2(x, dim):
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-6)


def _recurrent(q, k, v, beta, s0):
    """Token by token: an inner repeat over seq, the state as its carry."""
    order = ["seq", "batch", "heads"]
    stacked = {"q": md.transpose(q, order + ["d_k"]), "k": md.transpose(k, order + ["d_k"]),
               "v": md.transpose(v, order + ["d_v"]), "beta": md.transpose(beta, order)}

    def step(s, p):
        ks = md.einsum("batch heads d_k, batch heads d_k d_v -> batch heads d_v", p["k"], s)
        s = s + md.einsum("batch heads d_k, batch heads d_v -> batch heads d_k d_v", p["k"], (p["v"] - ks) * p["beta"])
        return s, {"o": md.einsum("batch heads d_k, batch heads d_k d_v -> batch heads d_v", p["q"], s)}

    _, per_step = md.repeat(step, s0, stacked, "seq")
    return md.transpose(per_step["o"], ["batch", "seq", "heads", "d_v"])


def _chunked(q, k, v, beta, s0, cfg):
    """Chunkwise: every chunk's W and U at once, then a repeat over chunks carrying S."""
    n = cfg.seq // cfg.chunk
    cut = {"q": q, "k": k}
    cut = {name: md.rearrange(t, "batch (chunks chunk) heads d_k -> chunks batch heads chunk d_k", chunks=n)
           for name, t in cut.items()}
    vc = md.rearrange(v, "batch (chunks chunk) heads d_v -> chunks batch heads chunk d_v", chunks=n)
    bc = md.rearrange(beta, "batch (chunks chunk) heads -> chunks batch heads chunk", chunks=n)
    t_, j_ = md.Dim("chunk", cfg.chunk), md.Dim("key_chunk", cfg.chunk)
    strict = md.cast(md.less(md.arange(j_), md.arange(t_)), torch.float32)        # [chunk, key_chunk]: j < t
    incl = md.cast(md.causal_mask(t_, j_), torch.float32)                           # j <= t
    kj = md.rename(cut["k"], chunk="key_chunk")
    a = md.einsum("chunks batch heads chunk d_k, chunks batch heads key_chunk d_k -> chunks batch heads chunk key_chunk",
                  cut["k"], kj) * bc * strict
    # (I + A)^-1 = sum_n (-A)^n, exact: A is strictly lower triangular, A^chunk = 0.
    eye = md.cast(md.equal(md.arange(t_), md.arange(j_)), torch.float32)
    power = -a
    inv = eye + power
    for _ in range(cfg.chunk - 2):
        power = -md.einsum("chunks batch heads chunk mid, chunks batch heads mid key_chunk -> chunks batch heads chunk key_chunk",
                           md.rename(power, key_chunk="mid"), md.rename(a, chunk="mid"))
        inv = inv + power
    kb = md.rename(cut["k"] * bc, chunk="key_chunk")
    vb = md.rename(vc * bc, chunk="key_chunk")
    w = md.einsum("chunks batch heads chunk key_chunk, chunks batch heads key_chunk d_k -> chunks batch heads chunk d_k", inv, kb)
    u = md.einsum("chunks batch heads chunk key_chunk, chunks batch heads key_chunk d_v -> chunks batch heads chunk d_v", inv, vb)
    qk = md.einsum("chunks batch heads chunk d_k, chunks batch heads key_chunk d_k -> chunks batch heads chunk key_chunk",
                   cut["q"], kj) * incl

    def step(s, p):
        u2 = p["u"] - md.einsum("batch heads chunk d_k, batch heads d_k d_v -> batch heads chunk d_v", p["w"], s)
        o = md.einsum("batch heads chunk d_k, batch heads d_k d_v -> batch heads chunk d_v", p["q"], s) + md.einsum(
            "batch heads chunk key_chunk, batch heads key_chunk d_v -> batch heads chunk d_v",
            p["qk"], md.rename(u2, chunk="key_chunk"))
        s = s + md.einsum("batch heads chunk d_k, batch heads chunk d_v -> batch heads d_k d_v", p["k"], u2)
        return s, {"o": o}

    _, per = md.repeat(step, s0, {"q": cut["q"], "k": cut["k"], "w": w, "u": u, "qk": qk}, "chunks")
    return md.rename(md.rearrange(per["o"], "chunks batch heads chunk d_v -> batch (chunks chunk) heads d_v"),
                     chunks_chunk="seq")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("recurrent", "chunk"):
        raise ValueError(f"form must be 'recurrent' or 'chunk', got {cfg.form!r}")
    B, S, D, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab)
    H, K, Dv, F, L = (md.Dim("heads", cfg.heads), md.Dim("d_k", cfg.d_k), md.Dim("d_v", cfg.d_v),
                      md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers))
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        params = {
            "wte": md.param("wte", [V, D], scale=0.5),
            "norm1": md.param("norm1", [L, D], init="ones"), "norm2": md.param("norm2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, K], fan_out=["layer", "heads", "d_k"]),
            "wk": md.param("wk", [L, D, H, K], fan_out=["layer", "heads", "d_k"]),
            "wv": md.param("wv", [L, D, H, Dv], fan_out=["layer", "heads", "d_v"]),
            "wb": md.param("wb", [L, D, H], fan_out=["layer", "heads"]),
            "wo": md.param("wo", [L, H, Dv, D], fan_out=["layer", "d_model"]),
            "w_in": md.param("w_in", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_out": md.param("w_out", [L, F, D], fan_out=["layer", "d_model"]),
            "normf": md.param("normf", [D], init="ones"),
            "head": md.param("head", [D, V], fan_out=["vocab"]),
        }
        s0 = md.broadcast_to(md.constant(0.0), md.Shape([B, H, K, Dv]))

        def block(x, p):
            h = md.rms_norm(x, "d_model", p["norm1"])
            q = _l2(md.einsum("batch seq d_model, d_model heads d_k -> batch seq heads d_k", h, p["wq"]), "d_k")
            k = _l2(md.einsum("batch seq d_model, d_model heads d_k -> batch seq heads d_k", h, p["wk"]), "d_k")
            v = md.einsum("batch seq d_model, d_model heads d_v -> batch seq heads d_v", h, p["wv"])
            beta = md.sigmoid(md.einsum("batch seq d_model, d_model heads -> batch seq heads", h, p["wb"]))
            o = _recurrent(q, k, v, beta, s0) if cfg.form == "recurrent" else _chunked(q, k, v, beta, s0, cfg)
            x = x + md.einsum("batch seq heads d_v, heads d_v d_model -> batch seq d_model", o, p["wo"])
            h = md.rms_norm(x, "d_model", p["norm2"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_in"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_out"])

        stacked = {n: params[n] for n in ("norm1", "norm2", "wq", "wk", "wv", "wb", "wo", "w_in", "w_out")}
        x = md.repeat(block, md.gather(params["wte"], ids, "vocab"), stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.rms_norm(x, "d_model", params["normf"]), params["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
